"""dualserve.models"""
