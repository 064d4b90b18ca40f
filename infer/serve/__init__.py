"""`specgraft serve`: the OpenAI-compatible HTTP layer over the scheduler, a room above the engine.

`server`: the FastAPI app and its routes; `protocol`: OpenAI's request and response shapes; `engine`: the thread
that steps the one `Scheduler` and hands each request its events; `metrics`: what /metrics exports. The engine
(`specgraft.infer` outside this package) never imports it.
"""

from specgraft.infer.serve.engine import Engine, EngineObserver, Job, QueueFull
from specgraft.infer.serve.metrics import Metrics
from specgraft.infer.serve.server import chat_prompt_ids, create_app, run_server

__all__ = ["Engine", "EngineObserver", "Job", "Metrics", "QueueFull", "chat_prompt_ids", "create_app", "run_server"]
