"""Speculative decoding under overlap scheduling: n-gram (prompt-lookup) or draft-model drafts verified in
one forward.

The hard part under overlap is that step N+1 is built before the host knows how many tokens step N
accepted. So everything that depends on it lives on the device (`device.SpecState`): each row's tokens
so far, its committed KV length and its prompt length. A verify batch names only its rows, how many
drafts each may try and the tokens' offsets; the device reads each row's position from what the
previous step accepted, drafts from the row's own tokens (`ngram`) or with the draft model, runs the
K+1 tokens through the extend attention, samples every position and accepts the longest run of drafts
the target confirms (`gapless.sampling.speculative`). The host keeps upper bounds (`Req.sampled` counts
every token a launched verify may produce), takes KV slots ahead for them, and gives back the rejected
ones when it processes the step (`gapless.engine.scheduler.verify`).

With `speculative_algorithm="draft"` a smaller model with the target's tokenizer drafts instead (`draft`):
it runs every forward the target runs, so its KV is caught up when a verify starts, and proposes K greedy
tokens per row from the row's committed position, read on the device like the rest.

`grammar`: a request under a grammar drafts n-grams too, each verify position masked with the grammar's
state after the drafts before it (the lookup repeated on the host when the mask is made).

`inputs` holds the batch fields (it imports nothing of the engine, so `engine.batch` can import it).
"""
