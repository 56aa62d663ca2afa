"""The HTTP ingress (`rollq ingress`): other services submit jobs, follow results as Server-Sent Events and cancel
them; and its typed Python client."""

from rollq.producer.ingress.app import Ingress, IngressStats
from rollq.producer.ingress.client import IngressClient, IngressError, SampleEvent
from rollq.producer.ingress.config import IngressConfig
from rollq.producer.ingress.models import JobSpec, JobStatus

__all__ = [
    "Ingress",
    "IngressClient",
    "IngressConfig",
    "IngressError",
    "IngressStats",
    "JobSpec",
    "JobStatus",
    "SampleEvent",
]
