"""The HTTP face: an OpenAI-compatible ASGI app over one `EngineLoop`.

    POST /v1/completions        prompt (text or token ids) -> text, streamed as server-sent events or not
    POST /v1/chat/completions   messages -> the assistant's reply (needs the checkpoint's chat template)
    GET  /v1/models             the one model served
    GET  /health                200 while the engine serves, 503 once it cannot
    GET  /metrics               Prometheus text

Bad bodies are 400s carrying the engine's message, a full queue is a 429 with Retry-After, a request the
engine failed is a 500 (or an error event in its stream) and every other request goes on. A client that
disconnects aborts its request at once.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import InklingError, RequestError
from ..requests import RequestOutput, prompt_ids
from .body import BodyTimeout, BodyTooLarge, Closing, Limits, ServerClosing, parse_json, read_body
from .chat import ChatTemplate, checked_messages
from .loop import STEP_BUCKETS, Frontend, QueueFull
from .protocol import (Job, Rules, ascii_json, chat_job, chat_logprobs, check_room, completion_job, completion_logprobs,
                       joined_logprobs, prompt_echo,
                       envelope, error_body, finish_reason, usage)
from .text import TextStream

# Work that grows with what a client sends or asks for runs off the event loop past these sizes (on a
# thread, which hands the interpreter back to the loop every few milliseconds), so that one large body
# or answer never holds up the other clients: a body is parsed, checked (a chat's messages rendered)
# and tokenized; an answer (logprobs for each of its tokens) is built and encoded.
CHECK_IN_THREAD_BYTES = 4096
ANSWER_IN_THREAD_TOKENS = 256


class ErrorResponse(JSONResponse):
    """A JSON error object (`ascii_json`)."""

    def render(self, content) -> bytes:
        return ascii_json(content)


def build_app(loop: Frontend, model_name: str, chat_template: ChatTemplate | None = None,
              default_max_tokens: int = 16, limits: Limits = Limits(), closing: Closing | None = None) -> FastAPI:
    """`default_max_tokens`: a completion's length when the body gives none (the API's default is 16).
    `closing`: set when a shutting-down server stops waiting; requests still reading their bodies get a 503."""
    closing = closing or Closing()
    tokenizer = loop.tokenizer
    if tokenizer is None:
        raise ValueError("serving needs the checkpoint's tokenizer.json (responses are text)")
    max_model_len = loop.max_model_len
    rules = Rules(max_model_len, loop.vocab_size, limits, default_max_tokens)
    app = FastAPI(title="inkling-compiled", docs_url=None, redoc_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # unknown routes and methods too
        return error(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                     "not_found_error" if e.status_code == 404 else "invalid_request_error")

    def error(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
        return ErrorResponse(error_body(message, kind), status_code=status, headers=headers)

    def check_model(body) -> None:
        name = body.get("model") if isinstance(body, dict) else None
        if name not in (None, "", model_name):
            raise LookupError(f"the model {name!r} does not exist: this server serves {model_name!r}")

    def render(messages) -> str:
        if chat_template is None:
            raise RequestError("this model has no chat template (no chat_template in its tokenizer_config.json): "
                               "use /v1/completions with a prompt")
        return chat_template.render(checked_messages(messages))

    def checked(raw: bytes, make_job) -> tuple[Job, list[int]]:
        body = parse_json(raw)
        check_model(body)
        job = make_job(body)
        return job, prompt_ids(job.prompt, tokenizer)

    async def admit(request: Request, make_job):
        """(the checked job, its subscription), or the error response that refuses it."""
        job = None
        try:
            raw = await read_body(request, limits, closing)
            if len(raw) > CHECK_IN_THREAD_BYTES:
                job, ids = await asyncio.to_thread(checked, raw, make_job)
            else:
                job, ids = checked(raw, make_job)
            check_room(job, len(ids), max_model_len)
            sub = await loop.submit(ids, job.params)
            if closing.is_set:  # it came past the shutdown's abort_all: every request ends, this one too
                loop.abort_all()
            return job, sub
        except ClientDisconnect:  # the client left while sending its body: nobody reads an answer
            return None, Response(status_code=499)
        except RequestError as e:  # the engine's checks name its own field; the client sent the API's
            field = (job.max_tokens_field if job is not None else None) or "max_tokens"
            return None, error(400, str(e).replace("max_new_tokens", field))
        except BodyTooLarge as e:  # the rest of the body is not read: the connection cannot carry another
            return None, error(413, str(e), headers={"Connection": "close"})
        except BodyTimeout as e:
            return None, error(408, str(e), headers={"Connection": "close"})
        except ServerClosing as e:
            return None, error(503, str(e), "server_error", headers={"Connection": "close"})
        except LookupError as e:
            return None, error(404, str(e), "not_found_error")
        except QueueFull as e:
            return None, error(429, str(e), "rate_limit_exceeded", headers={"Retry-After": "1"})
        except (RuntimeError, InklingError) as e:  # the engine can serve no more (closed, a rank died)
            return None, error(503, str(e), "server_error")

    async def serve(request: Request, make_job) -> object:
        job, sub = await admit(request, make_job)
        if job is None:
            return sub  # the error response
        answer = Answer(job, sub.request_id, model_name, tokenizer)
        if job.stream:
            return EventStream(stream_events(sub, answer), on_close=lambda: loop.abort(sub))
        watch = ClientWatch(request)
        try:
            while True:
                item = await next_output(sub, watch)
                if isinstance(item, BaseException):
                    return error(500, str(item), "server_error")
                if item.finish_reason == "error":
                    break
                answer.update(item)
                if answer.done:
                    break
        except asyncio.CancelledError:
            loop.abort(sub)
            raise
        except ClientGone:  # nobody reads the answer: free the request's slot now
            loop.abort(sub)
            return Response(status_code=499)
        if answer.stopped_early:
            loop.abort(sub, reason="stop")
        if item.finish_reason == "error":
            return error(500, f"the engine failed this request: {item.error}", "server_error")
        if len(item.token_ids) + (len(item.prompt_token_ids) if job.echo else 0) > ANSWER_IN_THREAD_TOKENS:
            return Response(await asyncio.to_thread(answer.encoded), media_type="application/json")
        return Response(answer.encoded(), media_type="application/json")

    async def stream_events(sub, answer: "Answer"):
        """The stream's events, one per output that brought tokens. Whatever has arrived when the handler
        wakes goes out as one block (its events still apart): behind by a step or more, a stream pays one
        socket write, not one per step, and its last event, usage and [DONE] go out together."""
        finished = ended = False
        try:
            while not (finished or ended):
                events = []
                for item in await arrived(sub.queue):
                    if isinstance(item, BaseException):
                        events.append(sse(error_body(str(item), "server_error")))
                        ended = True
                        break
                    if item.finish_reason == "error":
                        events.append(sse(error_body(f"the engine failed this request: {item.error}", "server_error")))
                        ended = True
                        break
                    events += [sse(chunk) for chunk in answer.update(item)]
                    finished = answer.done
                    if finished:
                        break
                if finished and answer.job.include_usage:
                    events.append(sse(answer.usage_chunk()))
                if finished or ended:
                    events.append(b"data: [DONE]\n\n")
                if events:
                    yield b"".join(events)
        finally:
            if not finished or answer.stopped_early:  # the client left (or a stop string ended it): free it now
                loop.abort(sub, reason="stop" if answer.stopped_early else "abort")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, lambda body: completion_job(body, rules))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, lambda body: chat_job(body, render, rules))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(loop.started),
                                            "owned_by": "inkling-compiled", "max_model_len": max_model_len}]}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if loop.failure is not None:
            return error(503, loop.failure, "server_error")
        return {"status": "ok"}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        try:
            text = await asyncio.to_thread(prometheus, loop)  # the engine's state waits for a step in progress
        except RuntimeError as e:  # the engine can serve no more
            return error(503, str(e), "server_error")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


class EventStream(StreamingResponse):
    """Server-sent events whose request is aborted however the response ends: a client that leaves before
    the first event never starts the stream's generator, whose own cleanup would do it (a no-op for a
    request that finished)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class ClientGone(Exception):
    """The client of a request that is not streamed closed its connection."""


class ClientWatch:
    """Asks at most every `every` seconds whether a request's client is still connected (outputs arrive
    every step, so the check cannot wait for a quiet moment)."""

    def __init__(self, request, every: float = 0.25):
        self.request, self.every = request, every
        self.due = time.monotonic() + every

    async def check(self) -> None:
        if time.monotonic() >= self.due:
            self.due = time.monotonic() + self.every
            if await self.request.is_disconnected():
                raise ClientGone()


async def next_output(sub, watch: ClientWatch):
    """The request's next output, or ClientGone once its client has left."""
    while True:
        await watch.check()
        try:
            return await asyncio.wait_for(sub.queue.get(), timeout=watch.every)
        except asyncio.TimeoutError:
            continue


async def arrived(queue: asyncio.Queue) -> list:
    """The queue's next item and every one already behind it."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


_json = msgspec.json.Encoder()


def sse(obj: dict) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


class Answer:
    """What a request has answered so far: text through its `TextStream`, and the chunks or the whole
    response that say it."""

    def __init__(self, job: Job, request_id: str, model: str, tokenizer):
        self.job, self.request_id, self.model, self.tokenizer = job, request_id, model, tokenizer
        self.text = TextStream(tokenizer, job.stops)
        self.out: RequestOutput | None = None
        self.tokens_sent = 0  # tokens whose logprobs went out in a chunk
        self.done = self.stopped_early = False
        self.started = False  # a chat stream opens with the assistant's role; an echo stream with the prompt
        self.echoed: tuple[str, dict | None] | None = None  # an echo answer's prompt text and logprobs
        self.echoed_chars = 0  # the length of that text, which the completion's text offsets follow

    def update(self, out: RequestOutput) -> list[dict]:
        """Takes the newest output; returns the stream chunks it adds: one for every output that brought
        tokens, its text possibly empty (an unfinished character, text held back for a stop string)."""
        self.out = out
        final = out.finished
        delta = self.text.update(self._answered_tokens(out), final)
        if self.text.stopped:
            self.done = True
            self.stopped_early = not final
        self.done = self.done or final
        upto = self.kept_tokens() if self.done else self._sendable_tokens()
        chunks = []
        if self.job.chat and not self.started:
            self.started = True
            chunks.append(envelope(self.job, self.request_id, self.model,
                                   {"delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}, chunk=True))
        if self.job.echo and not self.started:
            self.started = True
            text, logprobs = self._echo()
            chunks.append(envelope(self.job, self.request_id, self.model,
                                   {"text": text, "logprobs": logprobs, "finish_reason": None}, chunk=True))
        if delta or out.new_token_ids or self.done:
            choice = {"delta": {"content": delta}} if self.job.chat else {"text": delta}
            choice["logprobs"] = self._logprobs(self.tokens_sent, upto)
            choice["finish_reason"] = finish_reason(out, self.text.stopped, self.job.generates) if self.done else None
            chunk = envelope(self.job, self.request_id, self.model, choice, chunk=True)
            if self.job.continuous_usage:
                chunk["usage"] = usage(out, self.completion_tokens() if self.done else len(out.token_ids))
            chunks.append(chunk)
            self.tokens_sent = upto
        return chunks

    def _sendable_tokens(self) -> int:
        """Tokens whose logprobs may go out now: every token seen, unless a stop string may still cut the
        text (then only those whose text went out)."""
        return self.text.tokens_sent() if self.text.stops else len(self.text.offsets)

    def _answered_tokens(self, out: RequestOutput) -> list[int]:
        """The tokens the answer's text is made of: all of them, but for a stop token the request asked for
        (its text is not part of the answer, as with a stop string)."""
        tokens = out.token_ids
        if not self.job.generates:
            return []
        if out.finish_reason == "stop" and tokens and tokens[-1] in self.job.params.stop_token_ids:
            return tokens[:-1]
        return tokens

    def kept_tokens(self) -> int:
        """Tokens whose text the answer holds (what its logprobs cover)."""
        return self.text.tokens_within()

    def completion_tokens(self) -> int:
        """Tokens generated for the answer: all of them, or up to where a stop string cut the text."""
        if not self.job.generates:
            return 0
        return self.kept_tokens() if self.text.stopped else len(self.out.token_ids)

    def _echo(self) -> tuple[str, dict | None]:
        """The prompt's text and (with `logprobs`) its tokens' logprobs, which an echo answer starts with:
        made from the first output (its prompt logprobs are complete by then), once."""
        if self.echoed is None:
            self.echoed = prompt_echo(self.tokenizer, self.out, self.job.top_logprobs is not None)
            self.echoed_chars = len(self.echoed[0])
        return self.echoed

    def _logprobs(self, start: int, end: int, whole: bool = False) -> dict | None:
        """Logprobs of tokens [start, end) when the request asked for them; a chunk without tokens has none,
        a whole answer always has the object (empty when there are no tokens)."""
        if self.job.top_logprobs is None or (end <= start and not whole):
            return None
        if self.job.chat:
            return chat_logprobs(self.tokenizer, self.out, self.text.offsets, start, end)
        logprobs = completion_logprobs(self.tokenizer, self.out, self.text.offsets, start, end)
        logprobs["text_offset"] = [o + self.echoed_chars for o in logprobs["text_offset"]]
        return logprobs

    def whole(self) -> dict:
        n = self.kept_tokens()
        text = self.text.text
        reason = finish_reason(self.out, self.text.stopped, self.job.generates)
        prompt_text, prompt_logprobs = self._echo() if self.job.echo else ("", None)  # first: offsets follow it
        text = prompt_text + text
        logprobs = joined_logprobs(prompt_logprobs, self._logprobs(0, n, whole=True))
        choice = {"message": {"role": "assistant", "content": text}} if self.job.chat else {"text": text}
        body = envelope(self.job, self.request_id, self.model,
                        {**choice, "logprobs": logprobs, "finish_reason": reason}, chunk=False)
        body["usage"] = usage(self.out, self.completion_tokens())
        return body

    def encoded(self) -> bytes:
        return _json.encode(self.whole())

    def usage_chunk(self) -> dict:
        body = envelope(self.job, self.request_id, self.model, {}, chunk=True)
        body["choices"] = []
        body["usage"] = usage(self.out, self.completion_tokens())
        return body


def prometheus(loop: Frontend) -> str:
    """Prometheus text exposition of the core's counters and the engine's state."""
    state = loop.state()
    m, stats, now = state["metrics"], state["stats"], state["snapshot"]
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP inkling_{name} {help_text}")
        lines.append(f"# TYPE inkling_{name} {kind}")
        lines.extend(f"inkling_{name}{labels} {value}" for labels, value in samples)

    metric("requests_running", "gauge", "Requests holding a slot (prefilling or decoding).",
           [("", now["running"] + now["prefilling"])])
    metric("requests_waiting", "gauge", "Requests waiting for a slot.", [("", now["waiting"])])
    metric("slots_free", "gauge", "Free slots in the state pool.", [("", now["slots_free"])])
    metric("pages_free", "gauge", "Free KV pages in the state pool.", [("", now["pages_free"])])
    metric("pages_cached", "gauge", "KV pages the prefix cache holds.", [("", now["pages_cached"])])
    metric("prompt_tokens_total", "counter", "Prompt tokens of requests that produced output.", [("", m.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Tokens generated.", [("", m.generation_tokens)])
    metric("requests_finished_total", "counter", "Requests finished, by reason.",
           [(f'{{reason="{r}"}}', n) for r, n in sorted(m.finished.items())])
    metric("requests_rejected_total", "counter", "Requests refused with 429 (queue full).", [("", m.rejected)])
    buckets = [(f'_bucket{{le="{bound}"}}', n) for bound, n in zip(STEP_BUCKETS, m.step_buckets)]  # cumulative
    metric("step_seconds", "histogram", "Engine step time.",
           buckets + [('_bucket{le="+Inf"}', m.steps), ("_sum", m.step_seconds), ("_count", m.steps)])
    metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
           [("", stats.get("prefix_hit_tokens", 0))])
    metric("spec_proposed_tokens_total", "counter", "Draft tokens proposed (speculative decoding).",
           [("", stats["spec_proposed"])])
    metric("spec_accepted_tokens_total", "counter", "Draft tokens accepted.", [("", stats["spec_accepted"])])
    lines.append("")
    return "\n".join(lines)

