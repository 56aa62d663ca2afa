"""The OpenAI/Anthropic-compatible recording proxy that agent workflows talk to."""

from workers.proxy.server import ProxyConfig, RecordingProxy
from workers.proxy.sessions import CompletionRecord, Session, SessionStore

__all__ = ["CompletionRecord", "ProxyConfig", "RecordingProxy", "Session", "SessionStore"]
