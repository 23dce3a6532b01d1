"""``pagedq batch INPUT.jsonl OUTPUT.jsonl``: bulk offline processing of an OpenAI Batch file.

Input lines are OpenAI Batch requests::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}}

(``url`` may also be ``/v1/completions`` with a ``prompt``, or ``/v1/responses`` with a Responses API body:
``input``, ``instructions``, ``max_output_tokens``). Each becomes one pagedq job (a Responses line the same
chat job a chat line asking the same question becomes); each answer is one output line
``{id, custom_id, response: {status_code, request_id, body}, error}`` whose body is shaped like an OpenAI
``chat.completion`` / ``text_completion`` / ``response`` object with ``usage``. Lines that fail validation or
generation go to the errors file (default ``OUTPUT.errors.jsonl``) with the reason; the run goes on.

A request's ``model`` is accepted whatever it names, and the answer's ``body.model`` is the model that
served it, as OpenAI records it: an OpenAI batch file (``"model": "gpt-4o-mini"``) runs unchanged, and its
output says truthfully what answered (the run notes the difference once). Refusing mismatched lines would
refuse every line of such a file, for a name the workers of a queue never choose by.

Two ways to run the jobs, same output:

* through the queue (default): jobs go to ``<ns>:jobs:<queue>`` and however many workers serve that queue
  share them; this process only submits and collects results;
* ``--local``: an engine in this process (on an :class:`~worker.engine_thread.EngineThread`), no Redis.

Rerunning the same command resumes: every custom_id already in OUTPUT or the errors file is skipped (a line
without a usable custom_id by the SHA-256 of its bytes, never by its line number), so a run killed at any
point ends, once rerun, with each custom_id exactly once; ``--overwrite`` starts afresh,
first cancelling the jobs an interrupted run left queued or running (queue mode: each run keeps the ids of its
outstanding jobs in ``<ns>:batch-inflight:<hash of OUTPUT's path>``), which would otherwise run for nothing.

Exit codes: 0 every line has an output line, 3 every line has an output or error line but some are errors
(``--retry-errors`` runs them again), 1 Redis failed or stayed unreachable for 5 minutes
(rerun to resume), 2 bad arguments or input (duplicates, unreadable file, a pipe for a file), 74 OUTPUT or
the errors file could not be written (a full disk: rerun to resume once there is room), 130 interrupted
(rerun to resume).

One concept per module, each with the design choices that apply to it:

* :mod:`ops.batch.requests`: an input line -> a job (strict mapping, stable job ids);
* :mod:`ops.batch.responses`: a job's terminal event -> an output or errors-file record, token text;
* :mod:`ops.batch.files`: scanning the input, resuming from OUTPUT and the errors file, writing whole lines;
* :mod:`ops.batch.progress`: the bar or log lines;
* :mod:`ops.batch.backends`: the queue (Redis and workers) or an engine in this process;
* :mod:`ops.batch.command`: arguments, the run loop, exit codes (``python -m ops.batch`` runs it).
"""

from __future__ import annotations

from ops.batch.backends import Backend, LocalBackend, QueueBackend
from ops.batch.command import REDIS_GIVE_UP_S, add_arguments, main, run
from ops.batch.files import Scan, Writer, errors_path_for, iter_lines, read_done, scan_input
from ops.batch.progress import Progress
from ops.batch.requests import DEFAULT_MAX_TOKENS, BatchLine, LineError, body_to_fields, job_id_for, parse_line
from ops.batch.responses import (
    TerminalEvent,
    TokenText,
    error_record,
    has_token_texts,
    load_token_text,
    outcome_record,
    output_record,
    response_body,
    token_id_text,
)

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "REDIS_GIVE_UP_S",
    "Backend",
    "BatchLine",
    "LineError",
    "LocalBackend",
    "Progress",
    "QueueBackend",
    "Scan",
    "TerminalEvent",
    "TokenText",
    "Writer",
    "add_arguments",
    "body_to_fields",
    "error_record",
    "errors_path_for",
    "has_token_texts",
    "iter_lines",
    "job_id_for",
    "load_token_text",
    "main",
    "outcome_record",
    "output_record",
    "parse_line",
    "read_done",
    "response_body",
    "run",
    "scan_input",
    "token_id_text",
]
