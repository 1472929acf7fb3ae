"""`python -m serve` / `dsv4gen serve`: load a checkpoint, start the engine, then listen.

The socket is bound only after the model is loaded and the engine built, so "connection refused"
means "still loading" and a successful connect means the server can answer (vLLM's contract).
With no --model it serves the trained tiny checkpoint shipped with the package (`dsv4gen train-tiny`, seed 0).
On SIGINT / SIGTERM every open request ends at once (a stream with an error event, then [DONE]), its
caches are freed, and the process exits 0 without a traceback. Each request gets one log line
(`dsv4gen.serve.requests`, INFO, on stderr) unless --disable-log-requests.
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
from pathlib import Path
from typing import NamedTuple

from lib.launcher.arguments import add_parallel_arguments, launch_spec

BACKENDS = ("auto", "cpu", "ascend310p", "ascend910", "hip936")
TINY_NAME = "deepseek-v4-tiny"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serve", description="OpenAI-compatible DeepSeek-V4 server")
    p.add_argument("--model", help="checkpoint directory (default: the shipped trained tiny checkpoint)")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="auto: the device this machine has")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start-up)")
    p.add_argument("--served-model-name", help="the name clients send as `model` (default: the model folder)")
    p.add_argument("--max-model-len", type=int, help="context limit, prompt + output (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests decoded together")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    p.add_argument("--num-blocks", type=int, help="KV cache context blocks of block_tokens positions; each compress ratio m gets cdiv(N, m) + max-num-seqs blocks of entries (default: max-num-seqs full contexts)")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests waiting beyond max-num-seqs before new ones get 503 + Retry-After")
    p.add_argument("--speculative", choices=["dspark", "mtp", "deepseek_mtp", "none"],
                   help="default: the checkpoint's own drafter (DSpark, or the MTP layer of the Flash preview and Pro)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help="drafts per round (default: DSpark's block of 5; one MTP step, chained when more)")
    p.add_argument("--adaptive-drafting", action=argparse.BooleanOptionalAction, default=True,
                   help="draft only while drafting measures faster than plain decoding, each request as far as its "
                        "drafts survive (default); --no-adaptive-drafting drafts a full block at every decode step")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="never replay captured step graphs (default: graphs where the device has a graph API, "
                        "eager on the CPU emulation; --no-enforce-eager captures there too)")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", metavar="N",
                   help="batch sizes a step graph is captured for (default 1 2 4 8 16 ... up to --max-num-seqs)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize")
    p.add_argument("--expert-mode", choices=["resident", "streaming", "preconverted"],
                   help="how routed experts are held (ascend310p)")
    p.add_argument("--preconverted", help="folder written by `dsv4gen convert` (default: inside --model)")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    add_parallel_arguments(p)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per request (request id, tokens, finish status, latency)")
    return p


def detect_backend() -> str:
    """The backend for the accelerator this process can see; cpu when there is none."""
    import importlib
    try:
        importlib.import_module("torch_npu")        # registers torch.npu (Ascend machines only)
        import torch
        if torch.npu.is_available():
            return "ascend310p" if "310P" in torch.npu.get_device_name(0) else "ascend910"
    except ImportError:
        pass
    import torch
    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return "hip936"
    return "cpu"


class Prepared(NamedTuple):
    app: object
    context: object
    sock: socket.socket
    url: str


def prepare(argv: list[str] | None = None, *, out=None) -> Prepared:
    """Load, build the engine and the app, bind the socket (not yet accepting). Progress goes to `out`
    (default: stderr)."""
    from lib.engine.llm_engine import EngineConfig
    from lib.launcher.ranks import launch, watch
    from lib.weights.params import LoadOptions
    from lib.text.tokenizer import Tokenizer
    from serve.app import build_app
    from serve.async_engine import AsyncEngine
    from serve.context import ServerContext, generation_defaults
    from serve.metrics import ServerMetrics

    args = parser().parse_args(argv)
    out = out or sys.stderr
    for flag in ("max_num_seqs", "max_num_batched_tokens", "max_queued_requests", "max_request_bytes"):
        if getattr(args, flag) < (0 if flag == "max_queued_requests" else 1):
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.model:
        path, name = Path(args.model), args.served_model_name or Path(args.model).resolve().name
    else:
        from lib.weights.tiny_checkpoint import shipped_trained
        path, name = shipped_trained(), args.served_model_name or TINY_NAME
        print(f"using the shipped trained tiny checkpoint {path}", file=out)
    args.backend = detect_backend() if args.backend == "auto" else args.backend
    ranks = max(args.tp, args.ep)
    print(f"loading {path} for backend {args.backend}" + (f" on {ranks} ranks (TP={args.tp}, EP={args.ep})"
                                                          if ranks > 1 else ""), file=out)
    args.load_options = lambda a: LoadOptions(expert_mode=a.expert_mode, preconverted=a.preconverted)
    config = EngineConfig(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len, args.num_blocks,
                          args.speculative or "auto", args.enforce_eager,
                          None if args.cuda_graph_sizes is None else tuple(args.cuda_graph_sizes),
                          args.adaptive_drafting, args.num_speculative_tokens)
    engine = launch(launch_spec(args, path, config))
    tokenizer = Tokenizer.from_dir(path)
    metrics = ServerMetrics(name)
    bridge = AsyncEngine(engine, max_queued=args.max_queued_requests, on_output=metrics.on_output,
                         on_abort=metrics.on_abort, on_step=metrics.on_step)
    watch(engine, bridge.fail)                    # a dead worker (torchrun: a silent rank) turns /health 503
    metrics.attach(bridge)
    ctx = ServerContext(bridge, tokenizer, metrics, name, engine.max_model_len, engine.model.cfg.vocab_size,
                        generation_defaults(path), api_key=args.api_key, max_body_bytes=args.max_request_bytes)
    print(f"engine ready: {name}, max_model_len {engine.max_model_len}, max_num_seqs {args.max_num_seqs}, "
          f"speculative {engine.method or 'none'}, "
          f"{'graph mode' if getattr(engine, 'graphs', None) else 'eager'}", file=out)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {err.strerror}") from None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return Prepared(build_app(ctx), ctx, sock, f"http://{shown}:{port}")


def server_for(prepared: Prepared, log_level: str = "warning", announce=None, out=None):
    """A uvicorn Server on the prepared socket; `announce(url)` runs once it accepts connections.
    Its shutdown first ends every open request (uvicorn alone would wait for open streams until
    its graceful-shutdown timeout, then cancel them mid-write)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if announce is not None and not self.should_exit:
                announce(prepared.url)

        def handle_exit(self, sig, frame):
            # SIGINT / SIGTERM: shut down (open requests end at once, below). A second signal changes
            # nothing (uvicorn would force the exit and cancel the lifespan mid-shutdown, which logs a
            # traceback), and none is re-raised afterwards (uvicorn's default: a KeyboardInterrupt
            # inside asyncio's runner)
            self.should_exit = True

        async def shutdown(self, sockets=None):
            ended = prepared.context.engine.end_all("the server is shutting down")
            if out is not None:
                print(f"shutting down: {ended} open request(s) ended", file=out, flush=True)
            await super().shutdown(sockets=sockets)

    return Server(uvicorn.Config(prepared.app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5))


def main(argv: list[str] | None = None) -> int:
    from lib.runtime.hostmem import keep_freed_memory

    keep_freed_memory()                          # lib/runtime/hostmem.py: before torch is imported
    from lib.weights.checkpoint import CheckpointError
    from spec.yamlio import SpecError

    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("dsv4gen.serve.requests").setLevel(logging.WARNING if args.disable_log_requests
                                                         else logging.INFO)
    try:
        prepared = prepare(argv)
    except (SpecError, CheckpointError, FileNotFoundError, ValueError) as err:
        print(f"serve: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                    # Ctrl-C while loading: nothing to shut down
        print("serve: interrupted while loading", file=sys.stderr)
        return 130

    def announce(url: str) -> None:
        print(f"listening on {url}  (OpenAI API at {url}/v1)", flush=True)

    server = server_for(prepared, args.log_level, announce, out=sys.stderr)
    try:
        server.run(sockets=[prepared.sock])      # SIGINT / SIGTERM end it cleanly (Server.handle_exit)
    except KeyboardInterrupt:                    # a Ctrl-C before uvicorn's handlers were installed
        pass
    blocks = prepared.context.engine.snapshot.blocks
    print(f"server stopped; cache blocks in use: {sum(u for _, u, _ in blocks)} of {sum(t for _, _, t in blocks)}",
          file=sys.stderr, flush=True)
    return 0


def run_in_thread(prepared: Prepared) -> tuple[object, threading.Thread]:
    """Serve from a background thread (tests, benchmarks): returns once it accepts connections."""
    ready = threading.Event()
    server = server_for(prepared, announce=lambda url: ready.set())
    thread = threading.Thread(target=server.run, kwargs={"sockets": [prepared.sock]}, daemon=True)
    thread.start()
    if not ready.wait(120):
        raise RuntimeError("the server did not start within 120 s")
    return server, thread
