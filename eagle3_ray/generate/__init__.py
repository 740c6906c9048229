"""Generate stage: Ray Data feeds conversations to vLLM engine actors that regenerate responses and capture the
verifier's hidden states into safetensors shards with a Parquet manifest.

Follow it in this order: `plan.py` (samples, work units, replica resources; online training plans with it too) ->
`stage.py` (the actor pool; `mode.py`: what `mode=auto` runs) -> `engine.py` (the actor, engine arguments) ->
`engine_loop.py` (continuous batching on vLLM's async engine) -> `chat.py` (conversation <-> requests) -> `commit.py`
(background writers) -> `output.py` (the output directory and its contract).

Where vLLM enters: `connector.py` is never imported by this package. vLLM's workers load it by name
(`kv_connector_module_path="eagle3_ray.generate.connector"`, set in `engine.engine_kwargs`), and it writes each
request's captured hidden states where the request's `kv_transfer_params` say. `capture_model.py` enters as vLLM's
plugin (the `vllm.general_plugins` entry point): the verifier's class with the capture in its forward pass
(`generate.capture_method=forward`, the default). `scheduler.py` enters by name too (`scheduler_cls`, with
`generate.capture_method=extract_hidden_states`).
"""
