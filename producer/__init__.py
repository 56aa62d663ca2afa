"""How work enters rollq and how results come back: the Producer and the ResultConsumer."""

from producer.producer import BackpressureError, JobRequest, Producer, SubmitResult
from producer.results import Delivered, ResultConsumer

__all__ = ["BackpressureError", "Delivered", "JobRequest", "Producer", "ResultConsumer", "SubmitResult"]
