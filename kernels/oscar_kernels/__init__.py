"""oscar_kernels: INT2 KV-cache format, PyTorch references and Triton kernels (torch + triton only).

The format module is pure Python; the ops (torch, triton) load on first use, so a tool that only
names formats (the CLI's --help, the plugin's config) does not pay for importing torch.
"""
from .format import Int2Format, KVFormat, LayerBits, bits_per_element

_OPS = ("store_kv", "decode_attention", "extend_prefix_attention")

__all__ = ["Int2Format", "KVFormat", "LayerBits", "bits_per_element", *_OPS]
__version__ = "0.1.0"


def __getattr__(name):
    if name in _OPS:
        from . import ops

        return getattr(ops, name)
    raise AttributeError(f"module 'oscar_kernels' has no attribute {name!r}")
