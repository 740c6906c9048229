"""eagle3-ray: prompts -> verifier responses + hidden states -> an EAGLE-3 drafter proven faster in vLLM.

One folder per stage, each with a `stage.py` holding its `version(cfg)` and `run(cfg)`; `core/` holds what every
stage shares; `pipeline.py` runs the stages in order in one driver.

    core/      config, the stage skeleton, storage, telemetry, Ray start-up, layers, the capture contract, shards
    ingest/    prompt files -> clean conversations + rejects
    generate/  vLLM engine actors regenerate responses and capture hidden states into shards
    train/     Ray Train fits speculators' EAGLE-3 drafter (offline from shards, or online from live engines); export
    evaluate/  vLLM with and without the drafter: acceptance, speedup, the deploy gate
"""
