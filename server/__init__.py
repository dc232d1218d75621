"""dualserve.server"""
