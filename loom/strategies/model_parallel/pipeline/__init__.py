"""PipelineStrategy and its parts: cutting the model into stages (``split``), running a schedule
(``runner``) and holding each stage's state (``state``)."""
