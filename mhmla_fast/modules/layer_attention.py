"""placeholder"""
class FusedLayerAttention: pass
