"""The server's worker processes: tokenizer, scheduler (engine + model runner), detokenizer.

With `--data-parallel-size N` there are N schedulers, one per replica (`gapless.server.replicas`), and the
tokenizer stage routes each request to one (`gapless.server.router`).

Each is a child process (forked from the server's fork server, see `gapless.server.launch`) with a PULL
socket it binds and PUSH sockets to the next stage (`sockets`, messages of `gapless.server.protocol`); the
tokenizer and detokenizer stages run in a process each or share one (`text_worker`, the process layout of
`gapless.server.layout`). A worker that fails reports `Failed` to the API server; one that dies without a
word is noticed by the API server's watchdog. How a worker lives and ends is `child`.

One module per part: `tokenizer` (prompts to token ids), `scheduler_loop` (the engine's process),
`detokenizer` (token ids to text), `text_worker` (the process running the tokenizer stage, the
detokenizer stage or both); what they share: `child` (signals, failure report), `sockets` (addresses and
sockets), `request_log` (per-request log lines) and `replica_report` (data-parallel reports to the router).
"""
