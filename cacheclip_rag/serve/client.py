"""A running `cacheclip serve` in the place of an in-process engine, for the framework integrations:
`CacheClipSynthesizer("http://host:8000")` and `CacheClipGenerate("http://host:8000")` need no model in
the app's process. Requests go as OpenAI chat completions with the chunks as explicit documents
(`extra_body={"documents": [...]}`), streamed; `ingest` posts to `/v1/ingest`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..config import DEFAULT_SYSTEM_PROMPT, RequestOptions
from ..stages.request import Answer, Stream, Timings


@dataclass(frozen=True)
class RemoteConfig:
    """What the integrations read from an engine's config (and what `to_dict` records)."""

    url: str
    model: str = "cacheclip"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT


@dataclass(frozen=True)
class RemoteModel:
    name: str
    max_context: int


@dataclass
class RemoteEngine:
    """The subset of `Engine` the integrations use, over HTTP."""

    url: str
    api_key: str | None = None
    model: str = "cacheclip"
    timeout_s: float = 600.0
    config: RemoteConfig = field(init=False)
    primary: RemoteModel = field(init=False)

    def __post_init__(self) -> None:
        import httpx

        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"a server URL starts with http:// or https://, got {self.url!r}")
        self.url = self.url.rstrip("/")
        self._http = httpx.Client(timeout=self.timeout_s, headers={"Authorization": f"Bearer {self.api_key}"}
                                  if self.api_key else {})
        reply = self._http.get(self.url + "/v1/models")
        if reply.status_code != 200:
            raise ConnectionError(f"{self.url} answered {reply.status_code} to /v1/models: {reply.text[:200]}")
        info = next((m for m in reply.json()["data"] if m["id"] == self.model), None)
        if info is None:
            raise ValueError(f"{self.url} serves no model {self.model!r}")
        self.config = RemoteConfig(self.url, self.model, info.get("system_prompt", DEFAULT_SYSTEM_PROMPT))
        self.primary = RemoteModel(info.get("primary", self.model), int(info.get("context_window", 1 << 15)))

    def stream(self, question: str, texts: Sequence[str], options: RequestOptions | None = None) -> Stream:
        options = options or RequestOptions()
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": options.max_new_tokens, "temperature": options.temperature, "top_p": options.top_p,
                "messages": [{"role": "system", "content": options.system_prompt or self.config.system_prompt},
                             {"role": "user", "content": question}],
                "documents": list(texts), "cacheclip": {"method": options.method, "ratio": options.ratio,
                                                            "selection": options.selection,
                                                            "aux_share": options.aux_share,
                                                            "spread_ratio": options.spread_ratio,
                                                            "min_recompute_tokens": options.min_recompute_tokens}}
        if options.stop:
            body["stop"] = list(options.stop)
        if options.seed is not None:
            body["seed"] = options.seed
        stream = Stream(iter(()))
        stream.pieces = self._pieces(body, options, stream)
        return stream

    def _pieces(self, body: dict, options: RequestOptions, stream: Stream) -> Iterator[str]:
        started, text, usage, first = time.perf_counter(), [], None, None
        with self._http.stream("POST", self.url + "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                reply.read()
                raise RuntimeError(f"{self.url} refused the request ({reply.status_code}): {reply.text[:300]}")
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"{self.url}: {event['error']['message']}")
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        first = first or time.perf_counter() - started
                        text.append(piece)
                        yield piece
        import torch

        ours = (usage or {}).get("cacheclip", {})
        timings = Timings(ttft_s=first or 0.0, store=ours.get("timings", {}).get("store", {}))
        stream.answer = Answer(text="".join(text), token_ids=[], method=ours.get("method", options.method),
                               ratio=options.ratio, prompt_tokens=(usage or {}).get("prompt_tokens", 0),
                               recomputed_tokens=ours.get("recomputed_chunk_tokens", 0), first_logits=torch.empty(0),
                               timings=timings, reused_tokens=(usage or {}).get("prompt_tokens_details", {}).get(
                                   "cached_tokens", 0))

    def ingest(self, texts: Sequence[str], *, progress: bool = False, owners: Sequence[str] | None = None,
               groups: Sequence[str | None] | None = None) -> list[bytes]:
        """The texts' caches computed and stored by the server, each under its owner's id (default: the
        sha256 of its text) and group, which `release` deletes there."""
        body = {"documents": list(texts), **({"ids": list(owners)} if owners is not None else {}),
                **({"groups": list(groups)} if groups is not None else {})}
        reply = self._http.post(self.url + "/v1/ingest", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"{self.url} refused the documents ({reply.status_code}): {reply.text[:300]}")
        return [bytes.fromhex(k) for k in reply.json()["keys"]]

    def owners_of(self, group: str) -> list[str]:
        return []  # the server does not list a group's ids: `release(group=...)` deletes them there

    def release(self, owners: Sequence[str] = (), group: str | None = None) -> int:
        """The server's `POST /v1/documents/delete`: how many entries it deleted."""
        if not owners and group is None:
            return 0
        body = {"ids": list(owners), **({"group": group} if group is not None else {})}
        reply = self._http.post(self.url + "/v1/documents/delete", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"{self.url} refused the delete ({reply.status_code}): {reply.text[:300]}")
        return int(reply.json()["deleted_entries"])


def engine_or_remote(engine, api_key: str | None = None):
    """An in-process engine as given, or a server URL as a `RemoteEngine`."""
    return RemoteEngine(engine, api_key) if isinstance(engine, str) else engine
