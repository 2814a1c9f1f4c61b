"""The fake vLLM's configuration, and the flags of ``python -m simulate.fakes.engine`` that set it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from simulate.fakes.engine_shutdown import ENDINGS
from simulate.fakes.openai_format import ChatParsers


@dataclass(frozen=True)
class EngineConfig:
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    engines: int = 1  # data-parallel engines, one series each
    tokens_per_s: float = 50.0
    max_running: int = 256  # per engine; beyond it requests wait
    kv_blocks: int = 1000  # per engine; a running stream holds one block per 16 tokens
    leak_disconnected: bool = False  # keep counting a stream whose client went away, as vLLM's gauges can
    # The page shows the gauges as they were this long ago: Ray's metrics agent exports every
    # metrics_report_interval_ms (10 s by default), TGI sets its batch size only once a prefill returns.
    report_delay_s: float = 0.0
    # A stream leaves the gauges this long before its last bytes and the end of its response, as a client still
    # receiving buffered bytes does after vLLM has counted the request finished.
    linger_s: float = 0.0
    metrics_port: int | None = None  # also serve on this port, as Ray's metrics agent does beside Serve's
    max_model_len: int = 32768
    fault: str | None = None  # one of FAULTS: how each stream fails once it has sent ``fault_after`` tokens
    fault_after: int = 0
    # How vLLM ends its open streams on SIGTERM (engine_shutdown.ENDINGS: abort, error, hang), and its
    # --shutdown-timeout: seconds it goes on serving them first (0, its default: none).
    sigterm_ending: str = "abort"
    shutdown_timeout_s: float = 0.0
    # Tokens that end inside a multi-byte character stream as empty text, as on a byte-level tokenizer (see tokens).
    partial_utf8: bool = True
    # What becomes of ``return_token_ids``: one of TOKEN_IDS.
    token_ids: str = "returned"
    # Up to this many engine steps per chunk, as vLLM sends them when its API server falls behind (the steps not yet
    # sent are merged: RequestOutputCollector in vllm/v1/engine/output_processor.py). 1: one token per chunk.
    merge_steps: int = 1
    # vLLM's --reasoning-parser (REASONING_PARSERS), --tool-call-parser (TOOL_PARSERS) and --enable-auto-tool-choice.
    # With either parser the model is a thinking one (simulate/fakes/thinking.py): a chat's reply reasons for
    # ``reasoning_tokens`` tokens, answers and, where tools are offered, calls them (fakes/reasoning_frames.py).
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    auto_tool_choice: bool = False
    reasoning_tokens: int = 200
    # An idle keep-alive connection is closed after this: vLLM's uvicorn is started with
    # timeout_keep_alive=VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default (vllm/envs.py).
    keepalive_s: float = 5.0

    @property
    def thinking(self) -> bool:
        return self.reasoning_parser is not None or self.tool_call_parser is not None

    @property
    def chat_parsers(self) -> ChatParsers | None:
        """The parsers a chat's prompt is rendered for; None: served without them."""
        return ChatParsers(self.reasoning_parser, self.tool_call_parser) if self.thinking else None


# drop: the TCP connection closes mid-stream; abort: finish_reason "abort"; error: vLLM's error event; hang: no more
# bytes, connection open; garbage: bytes that are not SSE, with the 200; unavailable: a 503 before any stream.
FAULTS = ("drop", "abort", "error", "hang", "garbage", "unavailable")
# returned: vLLM 0.32.0's ``token_ids`` and ``prompt_token_ids``; ignored: an engine without the field (vLLM logs
# unknown fields and goes on, so its older releases answer without ids); refused: an OpenAI-compatible server that
# answers an unknown field with a 400 naming it.
TOKEN_IDS = ("returned", "ignored", "refused")
REASONING_PARSERS = ("deepseek_r1", "qwen3")
TOOL_PARSERS = ("hermes",)


def parse_flags(argv: list[str] | None, *, description: str | None) -> tuple[argparse.Namespace, EngineConfig]:
    parser = argparse.ArgumentParser(prog="python -m simulate.fakes.engine", description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--engines", type=int, default=1, help="data-parallel engines (one series each)")
    parser.add_argument("--tokens-per-second", type=float, default=EngineConfig.tokens_per_s)
    parser.add_argument("--max-running", type=int, default=EngineConfig.max_running)
    parser.add_argument("--leak-disconnected", action="store_true", help="keep counting streams whose client left")
    parser.add_argument("--report-delay", type=float, default=0.0, help="seconds the metrics page lags the engine")
    parser.add_argument("--linger", type=float, default=0.0, help="seconds a stream stays open after its gauge drops")
    parser.add_argument("--fault", choices=FAULTS, help="fail every stream this way (see FAULTS)")
    parser.add_argument("--fault-after", type=int, default=0, help="tokens a stream sends before its fault")
    parser.add_argument("--sigterm-ending", choices=ENDINGS, default="abort", help="how SIGTERM ends open streams")
    parser.add_argument("--shutdown-timeout", type=float, default=0.0, help="vLLM's --shutdown-timeout, seconds")
    parser.add_argument("--token-ids", choices=TOKEN_IDS, default="returned", help="what return_token_ids does")
    parser.add_argument(
        "--no-partial-utf8", action="store_true", help="generate whole characters only (text round-trips as ids)"
    )
    parser.add_argument("--merge-steps", type=int, default=1, help="up to this many tokens per chunk, as under load")
    parser.add_argument("--model-dir", help="read the checkpoint here before listening (config.json, shard headers)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, help="split chats' reasoning, as vLLM's")
    parser.add_argument("--tool-call-parser", choices=TOOL_PARSERS, help="stream tool calls, as vLLM's")
    parser.add_argument("--enable-auto-tool-choice", action="store_true", help="let the model call tools it chooses")
    parser.add_argument(
        "--reasoning-tokens", type=int, default=EngineConfig.reasoning_tokens, help="tokens a chat reasons for"
    )
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")  # vLLM's cli_args.py refuses it too
    config = EngineConfig(
        model=args.model,
        engines=args.engines,
        tokens_per_s=args.tokens_per_second,
        max_running=args.max_running,
        leak_disconnected=args.leak_disconnected,
        report_delay_s=args.report_delay,
        linger_s=args.linger,
        fault=args.fault,
        fault_after=args.fault_after,
        sigterm_ending=args.sigterm_ending,
        shutdown_timeout_s=args.shutdown_timeout,
        partial_utf8=not args.no_partial_utf8,
        token_ids=args.token_ids,
        merge_steps=max(1, args.merge_steps),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_tokens=max(1, args.reasoning_tokens),
    )
    return args, config
