"""CPU stand-ins for device behaviour: the batch-invariant matmul and the torch_npu op emulation.

What a device op computes and which quirks it has, without the device. Must not know the model,
tensor names or any backend's lowering choices; imports only `lib.guard`.
"""
