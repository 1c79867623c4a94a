"""Remote judges: ``{url: URL, kind: openai | score, ...}`` in ``training.rewards`` (or ``log.eval_rewards``), a server
that scores each completion, asked over HTTP in TRL's reward function shape.

Two protocols (``kind``):

- ``openai``: an OpenAI-compatible chat completions endpoint (``URL`` is the endpoint itself, such as
  ``http://judge:8000/v1/chat/completions``). Each completion is one request whose user message is ``prompt`` with
  ``{prompt}``, ``{completion}`` and ``{<record field>}`` filled in (a placeholder it does not know stays as written),
  at temperature 0 and at most ``max_tokens`` tokens, for the served ``model`` when given; the score is the last match
  of ``pattern`` in the reply (its group, when it has one), by default the last number in it.
- ``score``: a scoring endpoint in the shape of OpenRLHF's remote reward model: each completion is one request
  ``{"query": [prompt + completion], "prompts": [prompt], "labels": [label]}`` (the label: the record's field
  ``label_field``, else null), answered by ``{"rewards": [score]}``.

A batch's requests go out at once, at most ``max_in_flight`` of them waiting for an answer, each on a connection its
worker keeps open. A request that gets no answer within ``timeout`` seconds, cannot connect, or is answered with HTTP
429 or 5xx is sent again after ``backoff`` seconds, doubling, up to ``retries`` times. Any other answer that is not a
score (another HTTP error, a reply without a number, a value that is not finite) is not retried. A completion still
unscored is a broken reward (``on_error: stop``, the default): the run stops with an error naming the judge, its
address, the prompt and what went wrong. With ``on_error: none`` it stays unscored (None: "does not apply"), a warning
says how many and why (at most once a minute), and the metrics count them (``judge_failures/<name>``).

The key (``api_key_env``: the name of an environment variable) is read from the trainer's environment when the judge
is loaded, sent as ``Authorization: Bearer``, and written nowhere: not in the YAML, which may only name the variable,
nor in a rendered file (the host passes the variable by name), nor in a message.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass

from astrai.common.reward_specs import JudgeSpec
from astrai.trainer.objectives.rewards import Reward, RewardError

RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP answers that say "try again later"."""
WARN_EVERY_SECONDS = 60.0


@dataclass(frozen=True)
class Verdict:
    """What a judge said of one completion: its score, or why there is none."""

    score: float | None
    error: str | None = None


class JudgeRefused(Exception):
    """An answer that is not a score and that asking again would not change."""


class RemoteJudge:
    """One remote judge, called as a reward function; see the module's docstring."""

    def __init__(self, spec: JudgeSpec, key: str | None = None, warn=None):
        self.spec, self._key = spec, key
        parts = urllib.parse.urlsplit(spec.url)
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._pattern = re.compile(spec.pattern)
        self._warn = warn or _stderr
        self._warned_at = -math.inf

    def __call__(self, prompts: list[str], completions: list[str], **fields) -> list[float | None]:
        bodies = [
            self._body(prompts[row], completions[row], {name: values[row] for name, values in fields.items()})
            for row in range(len(completions))
        ]
        verdicts = self.ask_all(bodies)
        failed = [(row, verdict.error) for row, verdict in enumerate(verdicts) if verdict.error is not None]
        if failed and self.spec.on_error == "stop":
            row, error = failed[0]
            raise RewardError(
                f"judge {self.spec.name} ({self.spec.url}) could not score the completion of prompt "
                f"{_short(prompts[row])} ({len(failed)} of {len(verdicts)} unscored): {error}; set on_error: none "
                "in its entry to go on with them unscored"
            )
        if failed and time.monotonic() - self._warned_at >= WARN_EVERY_SECONDS:
            self._warned_at = time.monotonic()
            self._warn(
                f"warning: judge {self.spec.name} ({self.spec.url}) left {len(failed)} of {len(verdicts)} completions "
                f"unscored (on_error: none): {failed[0][1]}"
            )
        return [verdict.score for verdict in verdicts]

    def _body(self, prompt: str, completion: str, fields: dict) -> dict:
        if self.spec.kind == "score":
            label = fields.get(self.spec.label_field) if self.spec.label_field else None
            return {"query": [prompt + completion], "prompts": [prompt], "labels": [label]}
        values = {**{name: "" if value is None else str(value) for name, value in fields.items()}}
        values.update(prompt=prompt, completion=completion)
        text = re.sub(r"\{(\w+)\}", lambda match: values.get(match[1], match[0]), self.spec.prompt)
        body = {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": self.spec.max_tokens}
        if self.spec.model is not None:
            body["model"] = self.spec.model
        return body

    def ask_all(self, bodies: list[dict]) -> list[Verdict]:
        """Each request's verdict, at most ``max_in_flight`` waiting at once (daemon workers: one that hangs never keeps
        the process from exiting)."""
        verdicts: list[Verdict | None] = [None] * len(bodies)
        taken = iter(range(len(bodies)))
        lock = threading.Lock()

        def work() -> None:
            connection = None
            while True:
                with lock:
                    row = next(taken, None)
                if row is None:
                    break
                verdicts[row], connection = self._ask(bodies[row], connection)
            if connection is not None:
                connection.close()

        workers = [
            threading.Thread(target=work, name=f"judge-{self.spec.name}", daemon=True)
            for _ in range(min(self.spec.max_in_flight, len(bodies)))
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return verdicts

    def _ask(self, body: dict, connection) -> tuple[Verdict, object]:
        """One completion's verdict, retried as the spec says; the connection to keep using."""
        payload = json.dumps(body).encode("utf-8")
        error = "no request was made"
        for attempt in range(self.spec.retries + 1):
            if attempt:
                time.sleep(self.spec.backoff * 2 ** (attempt - 1))
            try:
                connection = connection or self._connect()
                status, answer = self._post(connection, payload)
            except (OSError, http.client.HTTPException) as failure:
                if connection is not None:
                    connection.close()
                connection = None
                error = f"{type(failure).__name__}: {failure}" if str(failure) else type(failure).__name__
                if isinstance(failure, TimeoutError):
                    error = f"no answer within {self.spec.timeout:g} s (timeout)"
                continue
            if status in RETRIED_STATUSES:
                error = f"HTTP {status}: {_excerpt(answer)}"
                continue
            if status != 200:
                return Verdict(None, f"HTTP {status}: {_excerpt(answer)}"), connection
            try:
                return Verdict(self._score(answer)), connection
            except JudgeRefused as refused:
                return Verdict(None, str(refused)), connection
        tries = self.spec.retries + 1
        return Verdict(None, f"{error} (after {tries} attempt{'s' if tries > 1 else ''})"), connection

    def _connect(self):
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return kind(self._host, self._port, timeout=self.spec.timeout)

    def _post(self, connection, payload: bytes) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key}"
        connection.request("POST", self._path, body=payload, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()

    def _score(self, answer: bytes) -> float:
        """The score in a 200 answer; JudgeRefused naming what is wrong with it."""
        try:
            document = json.loads(answer)
        except ValueError:
            raise JudgeRefused(f"the answer is not JSON: {_excerpt(answer)}") from None
        if self.spec.kind == "score":
            found = document.get("rewards") if isinstance(document, dict) else None
            found = found[0] if isinstance(found, list) and len(found) == 1 else found
            value = found
        else:
            try:
                reply = document["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError):
                raise JudgeRefused(f"the answer has no choices[0].message.content: {_excerpt(answer)}") from None
            matches = list(self._pattern.finditer(reply if isinstance(reply, str) else ""))
            if not matches:
                raise JudgeRefused(f"no score in the reply {_short(str(reply))} (pattern {self.spec.pattern!r})")
            last = matches[-1]
            value = last.group(1) if self._pattern.groups else last.group(0)
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise JudgeRefused(f"the score {value!r} in the reply {_short(str(reply))} is not a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            where = 'a "rewards" list of one finite number' if self.spec.kind == "score" else "a finite number"
            raise JudgeRefused(f"expected {where}, got {_excerpt(answer)}")
        return float(value)


def load_judge(spec: JudgeSpec, log=None) -> Reward:
    """The judge of ``spec``; RewardError when its key's variable is not set."""
    key = None
    if spec.api_key_env is not None:
        key = os.environ.get(spec.api_key_env)
        if not key:
            raise RewardError(
                f"judge {spec.name} ({spec.url}): its key's variable {spec.api_key_env} (api_key_env) is not set in "
                "the trainer's environment; set it in the shell that runs invoke, which passes it to the container "
                "by name"
            )
    return Reward(spec, RemoteJudge(spec, key, log))


def _excerpt(answer: bytes, limit: int = 160) -> str:
    text = answer.decode("utf-8", errors="replace").strip()
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
