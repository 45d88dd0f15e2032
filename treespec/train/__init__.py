"""Training and measurement tooling (not the decoding core): the default pair's recipe (``pair``,
``pair_data``, ``code_prompts``), atomic checkpoints (``checkpoint``), greedy-acceptance measurement
(``acceptance``) and the temperature calibration fit (``calibration``)."""
