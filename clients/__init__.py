"""dualserve.clients"""
