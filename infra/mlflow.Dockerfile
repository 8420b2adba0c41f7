# The MLflow tracking server of docker-compose.yml: Postgres for runs, MinIO (S3) for
# artifacts, which the server proxies, so clients need no S3 credentials.
FROM python:3.11-slim-bookworm

RUN pip install --no-cache-dir mlflow==3.17.2 psycopg2-binary==2.9.13 boto3==1.44.8
