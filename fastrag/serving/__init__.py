"""Serving: `AsyncEngine` (an asyncio front to the batched engine) and `fastrag serve` (HTTP, OpenAI-style)."""

from fastrag.serving.async_engine import AsyncEngine, Event, QueueFull

__all__ = ["AsyncEngine", "Event", "QueueFull"]
