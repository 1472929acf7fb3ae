"""Hand-written composites shared by the device backends (fixed-shape, sync-free, no fp64).

Each function has its graph op's port signature plus keyword parameters a backend binds (compute
dtype, device-op callables). They must not import a backend's device module: backends pass in
what to launch, so the same composite serves 310P, 910 and gfx936.
"""
