# SGLang's gateway for deploy/kubernetes/components/gateway (smg is not in rollq's image):
#   docker build -f deploy/gateway.Dockerfile -t YOUR-REGISTRY/rollq-gateway:smg-1.13.0 deploy
FROM python:3.12-slim
RUN pip install --no-cache-dir smg==1.13.0
USER 65534:65534
