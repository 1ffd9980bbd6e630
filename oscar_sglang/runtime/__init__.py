"""The server side: everything the `sglang.srt.plugins` entry point (runtime.plugin:register)
loads into SGLang's launcher and scheduler processes. Imports nothing from oscar_sglang.tools."""
