"""How work enters rollq and how results come back: the Producer and the ResultConsumer."""

from rollq.producer.producer import BackpressureError, JobRequest, Producer, SubmitResult
from rollq.producer.results import Delivered, ResultConsumer

__all__ = ["BackpressureError", "Delivered", "JobRequest", "Producer", "ResultConsumer", "SubmitResult"]
