-- One Postgres for both services: Prefect's database is created from POSTGRES_DB,
-- MLflow's here (run once, when the data volume is first initialised).
CREATE DATABASE mlflow;
