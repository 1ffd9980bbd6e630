"""Deprecated name of channel_decode, kept while the runtime still imports it (its start-up
check of the removed kernel switches reads PLANES_MIN_DIM here): importing this module gives
channel_decode itself. Remove it once nothing imports oscar_kernels.triton.attend_channel."""
import sys

from . import channel_decode

sys.modules[__name__] = channel_decode
