"""fleetd.store"""
