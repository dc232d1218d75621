"""dualserve.decoders"""
