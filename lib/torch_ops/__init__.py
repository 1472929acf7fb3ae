"""Device ops as registered torch ops: the recorded op schemas (`schemas`) and their registration
in the project's `dsv4gen` torch.library namespace (`registry`). Imports only the guard below it."""
