-- The database role of timer-service: it logs in, owns one schema and nothing else.
-- Run as a superuser (or a role with CREATEROLE) in the database Timer will use, then give
-- the role its password without writing it here: \password timer (in psql).
CREATE ROLE timer LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
-- Timer's tables go to the schema named after the role: "$user" leads the default
-- search_path, and since PostgreSQL 15 nobody may create tables in "public" by default.
CREATE SCHEMA timer AUTHORIZATION timer;
