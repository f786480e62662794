"""The gateway: OpenAI REST and gRPC front ends over a pool of decode and prefill nodes.

A request is validated, templated and tokenized here, routed to a decode node (which asks a
prefill node for the prompt's KV), and streamed back as text: the gateway detokenizes and applies
stop strings, the nodes only see token ids.
"""
