"""oscar_kernels: INT2 KV-cache format, PyTorch references and Triton kernels (torch + triton only)."""
from .format import Int2Format, KVFormat, LayerBits, bits_per_element
from .ops import decode_attention, extend_prefix_attention, store_kv

__all__ = [
    "Int2Format",
    "KVFormat",
    "LayerBits",
    "bits_per_element",
    "store_kv",
    "decode_attention",
    "extend_prefix_attention",
]
__version__ = "0.1.0"
