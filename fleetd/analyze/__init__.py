"""fleetd.analyze"""
