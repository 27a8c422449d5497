"""fleetd.node"""
