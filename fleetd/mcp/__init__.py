"""fleetd.mcp"""
