"""A fake vLLM: streams tokens over an OpenAI-style API and serves vLLM's metrics, driven by real streams.

The metrics use vLLM's own names, HELP texts, labels (``model_name``, ``engine``) and histogram buckets, rendered by
prometheus_client as vLLM does. ``python -m simulate.fakes.engine --port 8000`` runs it on its own.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import signal
import time
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack, aclosing
from pathlib import Path

import structlog
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from simulate.fakes.engine_config import EngineConfig as EngineConfig  # where the tests and benchmarks take it
from simulate.fakes.engine_config import parse_flags
from simulate.fakes.engine_metrics import VllmMetrics
from simulate.fakes.engine_shutdown import Shutdown, aborted_at_once, end_stream, refused
from simulate.fakes.engine_tokenize import detokenize, tokenize
from simulate.fakes.openai_format import (
    DONE,
    InvalidRequest,
    Job,
    Output,
    Stream,
    chunk_size,
    error_body,
    read_job,
    token_id_prompt,
)
from simulate.fakes.reasoning_frames import ChatFrames, Parsers, parsed
from simulate.fakes.thinking import END_OF_TURN, continuation
from simulate.fakes.tokens import Context, Detokenizer

log = structlog.get_logger()

AUTO_TOOLS_REFUSED = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
# Mixed into the context of each choice after the first (``n`` > 1), so each is a sample of its own.
SAMPLE_SALT = 1 << 40


class FakeEngine:
    """The engine's state: streams per data-parallel engine, each holding a slot while it runs."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.metrics = VllmMetrics(config)
        self.slots = [asyncio.Semaphore(config.max_running) for _ in range(config.engines)]
        self.waiting = [0] * config.engines
        self.running = [0] * config.engines
        self.kv_tokens = [0] * config.engines
        self._next_engine = itertools.cycle(range(config.engines))
        self._ids = itertools.count(1)
        self.completed = 0
        self.cut = 0  # streams still open when the engine stopped
        self.shutdown = Shutdown(ending=config.sigterm_ending, timeout_s=config.shutdown_timeout_s)

    def labels(self, engine: int) -> dict[str, str]:
        return {"model_name": self.config.model, "engine": str(engine)}

    def _publish(self, engine: int) -> None:
        running, waiting, blocks = self.running[engine], self.waiting[engine], self.kv_tokens[engine] / 16
        if self.config.report_delay_s > 0:
            loop = asyncio.get_running_loop()
            loop.call_later(self.config.report_delay_s, self._show, engine, running, waiting, blocks)
        else:
            self._show(engine, running, waiting, blocks)

    def _show(self, engine: int, running: int, waiting: int, blocks: float) -> None:
        labels = self.labels(engine)
        self.metrics.running.labels(**labels).set(running)
        self.metrics.waiting.labels(**labels).set(waiting)
        self.metrics.kv_usage.labels(**labels).set(min(1.0, blocks / self.config.kv_blocks))

    def in_flight(self) -> int:
        return sum(self.running) + sum(self.waiting)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        config = self.config
        parsers = config.chat_parsers
        try:
            body = await request.json()
            job = read_job(
                body, chat=chat, max_model_len=config.max_model_len, token_ids=config.token_ids, parsers=parsers
            )
            if job.tools and not (config.auto_tool_choice and config.tool_call_parser):  # vLLM's online_renderer.py
                raise InvalidRequest(AUTO_TOOLS_REFUSED)
        except InvalidRequest as error:
            return web.json_response(error_body(str(error), kind=error.kind, param=error.param), status=400)
        except ValueError as error:  # a body that is not JSON
            return web.json_response(error_body(str(error) or "invalid request body"), status=400)
        if body.get("model", self.config.model) != self.config.model:  # vLLM 0.32.0 (measured)
            message = f"The model `{body['model']}` does not exist. Valid aliases: {self.config.model}."
            return web.json_response(error_body(message, kind="NotFoundError", code=404, param="model"), status=404)
        if self.shutdown.draining and (chat or not token_id_prompt(body)):
            return refused()
        if self.config.fault == "unavailable":
            return web.json_response(
                error_body("engine unavailable", kind="ServiceUnavailableError", code=503), status=503
            )
        engine = next(self._next_engine)
        prefix = "chatcmpl" if chat else "cmpl"
        identity = f"{prefix}-{next(self._ids):016x}"
        out = Stream(chat, identity, int(time.time()), self.config.model, job.token_ids, job.include_usage)
        if self.shutdown.draining:
            return await aborted_at_once(request, job, out)
        if not job.stream:
            return web.json_response(await self._generate_whole(job, out, engine=engine))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await self._stream(request, response, engine=engine, job=job, out=out)
        return response

    async def _generate_whole(self, job: Job, out: Stream, *, engine: int) -> dict[str, object]:
        ids: list[list[int]] = [[] for _ in range(job.n)]
        texts: list[list[str]] = [[] for _ in range(job.n)]
        ends: list[tuple[str, str | None]] = [("length", None)] * job.n
        async with aclosing(self._steps(job, engine=engine)) as steps:
            async for index, token, text, finish, stop in steps:
                ids[index].append(token)
                texts[index].append(text)
                if finish is not None:
                    ends[index] = (finish, stop)
        outputs = [Output("".join(t), f, s, i) for t, (f, s), i in zip(texts, ends, ids, strict=True)]
        if out.chat and self.config.thinking:  # the parsers' message, not the text
            outputs = [parsed(self._frames(job).parsers, o) for o in outputs]
        return out.whole(outputs, prompt_ids=job.prompt_ids)

    async def _steps(self, job: Job, *, engine: int) -> AsyncGenerator[tuple[int, int, str, str | None, str | None]]:
        """Every choice's steps, a token of each in turn: (choice, token, text, finish_reason, stop_reason), as vLLM
        0.32.0 streams ``n`` choices (measured: one choice per chunk, by index, interleaved step by step)."""
        async with AsyncExitStack() as stack:
            live = {
                i: await stack.enter_async_context(aclosing(self._tokens(job, engine=engine, choice=i)))
                for i in range(job.n)
            }
            while live:
                for index, tokens in list(live.items()):
                    try:
                        token, text, finish, stop = await anext(tokens)
                    except StopAsyncIteration:
                        del live[index]
                        continue
                    yield index, token, text, finish, stop

    async def _tokens(
        self, job: Job, *, engine: int, choice: int = 0
    ) -> AsyncGenerator[tuple[int, str, str | None, str | None]]:
        """One choice's steps: (token, its text, finish_reason, stop_reason), paced, counted. Choices after the first
        are samples of their own: their context starts from another state.

        A stop string ends the generation where it appears in the text, inside a token too, and is left out of the
        text (vLLM's default ``include_stop_str_in_output: false``); the token that completed it is still counted
        and returned among the ids, as vLLM 0.32.0 does (measured)."""
        labels = self.labels(engine)
        context = Context(job.prompt_ids, partial_utf8=self.config.partial_utf8)
        if choice:
            context.push(SAMPLE_SALT + choice)
        detokenizer = Detokenizer(job.prompt_ids, skip_special=job.skip_special_tokens)
        config = self.config
        planned, job_utf8 = [], config.partial_utf8
        if config.thinking and not choice:
            reply = continuation(job.prompt_ids, reasoning_tokens=config.reasoning_tokens, partial_utf8=job_utf8)
            planned = [step.token for step in reply or ()]
        if choice == 0:
            self.metrics.prompt_tokens.labels(**labels).inc(max(1, len(job.prompt_ids)))
        last = time.monotonic()
        generated = 0
        text = ""
        try:
            while generated < job.max_tokens:
                await asyncio.sleep(1 / self.config.tokens_per_s)
                token = planned[generated] if generated < len(planned) else context.next_token()
                context.push(token)
                now = time.monotonic()
                (self.metrics.ttft if generated == 0 else self.metrics.itl).labels(**labels).observe(now - last)
                last = now
                generated += 1
                self.kv_tokens[engine] += 1
                self.metrics.generation_tokens.labels(**labels).inc()
                self._publish(engine)
                if token == END_OF_TURN:  # its text left out (vllm/v1/engine/detokenizer.py, stop_terminated)
                    yield token, "", "stop", None
                    return
                piece = detokenizer.step(token)
                found = _first_stop(text, piece, job.stop)
                if found is not None:
                    at, stop = found
                    yield token, (text + piece)[len(text) : max(len(text), at)], "stop", stop
                    return
                text += piece
                yield token, piece, "length" if generated == job.max_tokens else None, None
        finally:
            self.kv_tokens[engine] -= generated

    async def _stream(
        self, request: web.Request, response: web.StreamResponse, *, engine: int, job: Job, out: Stream
    ) -> None:
        labels = self.labels(engine)
        started = time.monotonic()
        # Not published until the stream's first token: vLLM's gauges are set after each engine step, so they count
        # a request only once its first step (the prefill) is done (vLLM 0.32.0 CPU build, measured: 28 ms-0.99 s
        # after it was sent, about its first token).
        self.waiting[engine] += 1
        self.shutdown.opened()
        async with self.slots[engine]:
            self.waiting[engine] -= 1
            self.running[engine] += 1
            generated = 0
            leaked = released = False
            try:
                for index in range(job.n):
                    if (first := out.first(role=job.role, prompt_ids=job.prompt_ids, index=index)) is not None:
                        await response.write(first)
                sent = [0] * job.n
                frames = [self._frames(job) for _ in range(job.n)] if out.chat and self.config.thinking else None
                pending: dict[int, tuple[list[str], list[int]]] = {}  # steps not sent yet, by choice
                async with aclosing(self._steps(job, engine=engine)) as steps:
                    async for index, token, text, finish, stop in steps:
                        if self.shutdown.ending is not None:
                            self.cut += 1
                            await end_stream(self.shutdown.ending, request, response, job, out, generated=generated)
                            return
                        held = sum(len(ids) for _, ids in pending.values())
                        fault = self.config.fault if self._faults_at(generated + held) else None
                        if fault is not None and await end_stream(
                            fault, request, response, job, out, generated=generated
                        ):
                            return
                        if frames is not None:  # one step a chunk: the parsers' deltas are modelled per step
                            chunk = frames[index].chunk(out, token, text, finish=finish, stop=stop, index=index)
                            if chunk is not None:
                                await response.write(chunk)
                            generated += 1
                            continue
                        texts, ids = pending.setdefault(index, ([], []))
                        texts.append(text)
                        ids.append(token)
                        if finish is None and len(ids) < chunk_size(ids[0], self.config.merge_steps):
                            continue
                        first_ids = job.prompt_ids if sent[index] == 0 else None
                        chunk = out.token(
                            "".join(texts), ids, finish=finish, stop=stop, prompt_ids=first_ids, index=index
                        )
                        await response.write(chunk)
                        sent[index] += len(ids)
                        generated += len(ids)
                        del pending[index]
                if self.config.linger_s > 0:
                    self.running[engine] -= 1
                    released = True
                    self._publish(engine)
                    await asyncio.sleep(self.config.linger_s)
                if job.include_usage:
                    reasoning = None
                    if frames is not None and self.config.reasoning_parser is not None:
                        reasoning = sum(f.reasoning_tokens() for f in frames)
                    await response.write(out.usage(len(job.prompt_ids), generated, reasoning_tokens=reasoning))
                await response.write(DONE)
                await response.write_eof()
                self.completed += 1
                self.metrics.e2e.labels(**labels).observe(time.monotonic() - started)
            except ConnectionResetError:
                leaked = self.config.leak_disconnected
                log.info("engine.client_gone", request=out.id, generated=generated, leaked=leaked)
            except asyncio.CancelledError:
                self.cut += 1
                raise
            finally:
                if not leaked and not released:
                    self.running[engine] -= 1
                self._publish(engine)
                self.shutdown.closed()

    def _frames(self, job: Job) -> ChatFrames:
        config = self.config
        parsers = Parsers(config.reasoning_parser, config.tool_call_parser, job.tools, job.include_reasoning)
        return ChatFrames(parsers, with_ids=job.token_ids)

    def _faults_at(self, generated: int) -> bool:
        return self.config.fault is not None and generated == self.config.fault_after

    async def metrics_page(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, _: web.Request) -> web.Response:
        """vLLM's model list (vllm/entrypoints/openai/models/serving.py, ``show_available_models``)."""
        card = {
            "id": self.config.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.config.model,
            "parent": None,
            "max_model_len": self.config.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", functools.partial(tokenize, config=self.config))
        app.router.add_post("/detokenize", functools.partial(detokenize, config=self.config))
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/health", self.health)
        return app


def _first_stop(text: str, piece: str, stops: frozenset[str]) -> tuple[int, str] | None:
    """Where the first stop string completed by ``piece`` starts in ``text + piece``, and which one it is."""
    whole = text + piece
    found = [(at, stop) for stop in stops if (at := whole.find(stop, max(0, len(text) - len(stop) + 1))) >= 0]
    return min(found) if found else None


async def serve_engine(config: EngineConfig, *, host: str, port: int, stop: asyncio.Event) -> FakeEngine:
    """Serve until ``stop`` is set (SIGTERM), then end the open streams as vLLM does (``engine_shutdown``: with
    ``sigterm_ending``, or after ``shutdown_timeout_s``), and return once none is left."""
    engine = FakeEngine(config)
    runner = web.AppRunner(
        engine.app(), access_log=None, handle_signals=False, shutdown_timeout=0.1, keepalive_timeout=config.keepalive_s
    )
    await runner.setup()
    try:
        sites = [web.TCPSite(runner, host, port, reuse_address=True)]
        if config.metrics_port is not None:
            sites.append(web.TCPSite(runner, host, config.metrics_port, reuse_address=True))
        for site in sites:
            await site.start()
        log.info("engine.listening", host=host, port=port, model=config.model)
        await stop.wait()
        log.info("engine.stopping", streams=engine.shutdown.streams, ending=config.sigterm_ending)
        await engine.shutdown.run(sites)
    finally:
        await asyncio.shield(runner.cleanup())
    log.info("engine.stopped", completed=engine.completed, cut=engine.cut)
    return engine


def _load_model(directory: Path) -> None:
    """Read the checkpoint as an engine loads one before it listens; exits 1 when it is not there whole."""
    from simulate.model import load

    try:
        files, size = load(directory)
    except ValueError as error:
        log.error("engine.model_unreadable", path=str(directory), error=str(error))
        raise SystemExit(1) from None
    log.info("engine.model_loaded", path=str(directory), files=files, bytes=size)


def main(argv: list[str] | None = None) -> None:
    from spotdrain.logs import configure_logging

    args, config = parse_flags(argv, description=__doc__)
    configure_logging()
    if args.model_dir is not None:
        _load_model(Path(args.model_dir))

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve_engine(config, host=args.host, port=args.port, stop=stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()
