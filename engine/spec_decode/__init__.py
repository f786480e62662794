"""Speculative decoding: propose k tokens per decoding request cheaply, verify them all in the
target's one forward pass of the step, keep the longest run the target agrees with.

- proposer.py: the Proposer interface and its Proposal result.
- ngram.py: prompt lookup over the request's own tokens (one-hot draft distribution).
- draft_model.py: a smaller model with the same vocabulary, over its own paged KV cache.
- rejection_sampler.py: lossless verification (greedy and sampling).
- policy.py: when not to speculate (large batches, requests whose drafts keep failing).
- metrics.py: the counters the engine keeps (spec_decode_* metrics).
- speculator.py: the glue the engine calls around each step.

Verification happens inside the unified scheduler: a request with k drafts is scheduled for
1 + k tokens (Request.spec_token_ids), and the scheduler folds the accepted run back in.
This __init__ imports nothing: engine.model_runner imports the rejection sampler and the draft
model imports engine.model_runner, so eager imports here would be circular.
"""
