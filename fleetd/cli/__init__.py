"""fleetd.cli"""
