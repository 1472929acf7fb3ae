"""The capability guard: run code under a device's rules and refuse what the device cannot do.

Holds the dispatch mode that checks and counts every aten op (an op of the `dsv4gen` torch.library
namespace, a registered device op, as one launch), and the markers (`allow`, `section`) the code
below the engine uses to say what one allowed host sync is. Knows no backend by name; must not import anything of the project.
"""
