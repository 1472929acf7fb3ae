"""Number formats: bit-exact codecs, reference decoding of stored parts, runtime weight formats.

Must not know tensor names, layers, sharding or any backend; imports only `spec`, `lib.guard`
and `lib.emulation` (INT4 packing is the device's layout).
"""
