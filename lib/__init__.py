"""The hand-written layers between the spec and the server, one package per concern.

Above `spec` and `codegen`, from the bottom: `guard`, `records`, `text`, `console`, `engram` (no
project imports but `spec`); `torch_ops` (the device ops' schemas and registration); `distributed`, `emulation`; `quant`; `weights`; then `backends` (a sibling package);
`runtime`; `engine`; `launcher`; `evaluation`; `porting`, `planner` and `training`; `serve` (a sibling package); `bench`;
`cli`. A package imports only packages below it: the contracts in pyproject.toml ([tool.importlinter]) are checked in CI.
"""
