"""oscar-sglang: an INT2 KV cache for stock SGLang 0.5.17, loaded as a plugin."""
__version__ = "0.1.0"
