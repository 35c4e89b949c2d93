"""tandem engines: the model, the shared paged KV pool, continuous batching and sampling, and the engine loop
with its asyncio (`AsyncEngine`) and offline (`LLM`) faces."""

from engines.async_engine import AsyncEngine
from engines.config import EngineSpec, PoolSpec
from engines.core import EngineCore
from engines.errors import RequestRejected
from engines.llm import LLM
from engines.outputs import CompletionOutput, RequestOutput
from engines.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "CompletionOutput", "EngineCore", "EngineSpec", "PoolSpec", "RequestOutput",
           "RequestRejected", "SamplingParams"]
