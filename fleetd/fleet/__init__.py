"""fleetd.fleet"""
