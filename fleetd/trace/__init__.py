"""fleetd.trace"""
