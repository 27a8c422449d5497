"""fleetd.export"""
