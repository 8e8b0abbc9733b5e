-- Least-privilege roles for sqlalchemy-outbox on PostgreSQL: one for the relay sidecar, one
-- for the host app. Neither can change the schema (no CREATE, ALTER, DROP, TRUNCATE) and
-- neither can delete a message.
--
-- Run it AFTER `outbox-relay migrate`, as the owner of the outbox tables (the user `migrate`
-- runs as) or a superuser, connected to the database that holds them. psql fills in and
-- quotes the variables (:"x" as an identifier, :'x' as a string):
--
--   psql "postgresql://owner@db:5432/shop" -v ON_ERROR_STOP=1 \
--        -v relay_role=outbox_relay -v relay_password="$RELAY_PASSWORD" \
--        -v app_role=outbox_app -v app_password="$APP_PASSWORD" \
--        -f grants-postgresql.sql
--
-- Optional: -v schema=NAME when the outbox tables are not in schema public. The database
-- granted CONNECT is the one psql is connected to. Running it again is safe: existing roles
-- get the password set again and the same grants. To remove the roles, as the same user:
--   DROP OWNED BY outbox_relay, outbox_app; DROP ROLE outbox_relay, outbox_app;
--
-- Who may prune: neither role. `outbox-relay prune` deletes finished messages (and their
-- attempts with them), so it runs with the owner's credentials, the same as `migrate`: an
-- occasional job, not the always-on sidecar. A leaked relay or app password can then never
-- erase the delivery history. Operators' status, list, show, requeue and cancel work with
-- the relay role.
--
-- PostgreSQL 14 and older let every role (PUBLIC) create tables in schema public; there,
-- also run `REVOKE CREATE ON SCHEMA public FROM PUBLIC` if nothing else relies on it. Every
-- version lets PUBLIC create temporary tables (`REVOKE TEMPORARY ON DATABASE ... FROM
-- PUBLIC`). Both are database-wide decisions, so this script leaves them to you.

\set ON_ERROR_STOP on
\if :{?schema}
\else
\set schema public
\endif

SELECT format('CREATE ROLE %I LOGIN', :'relay_role')
 WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'relay_role') \gexec
SELECT format('CREATE ROLE %I LOGIN', :'app_role')
 WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'app_role') \gexec
ALTER ROLE :"relay_role" LOGIN PASSWORD :'relay_password';
ALTER ROLE :"app_role" LOGIN PASSWORD :'app_password';

GRANT CONNECT ON DATABASE :"DBNAME" TO :"relay_role", :"app_role";
GRANT USAGE ON SCHEMA :"schema" TO :"relay_role", :"app_role";

-- The relay (relay/store.py). Identity columns need no grant on their sequences, and LISTEN
-- needs none either.
--   outbox_messages: claim (SELECT ... FOR UPDATE SKIP LOCKED, then UPDATE), mark_send_started,
--     extend_lease, finalize, retry, fail, hold, release, sweep, expire: all UPDATEs that read
--     the row. The relay never inserts or deletes a message.
--   outbox_attempts: one INSERT per attempt and per swept send; SELECT for operators'
--     `show` (requeue and cancel add an attempt row too).
--   outbox_relays: register (INSERT, or take over a dead relay's row: UPDATE, SELECT),
--     heartbeat and stop (UPDATE).
--   outbox_send_budget, outbox_send_budget_lock: with --max-send-rate, every send is booked
--     (INSERT) after reading the bookings (SELECT) under the lock row (UPDATE; INSERT puts it
--     back if it is missing); old bookings are deleted (DELETE).
--   outbox_events: the event intake records each event once (INSERT, SELECT).
--   outbox_suppressions: the intake adds bounced and complaining addresses, each send reads
--     them, operators' `suppressions add/remove/import` change them (SELECT, INSERT, UPDATE,
--     DELETE).
--   outbox_operator_actions: every operator command records who did what (INSERT, SELECT).
--   outbox_intakes: each intake replica's heartbeat and the last time it found its queue
--     empty (INSERT, UPDATE, SELECT; the reconcile sweep reads it).
--   the views: SELECT, for `outbox-relay status` and /metrics (which reads outbox_lag).
GRANT SELECT, UPDATE ON :"schema".outbox_messages TO :"relay_role";
GRANT SELECT, INSERT ON :"schema".outbox_attempts TO :"relay_role";
GRANT SELECT, INSERT, UPDATE ON :"schema".outbox_relays TO :"relay_role";
GRANT SELECT, INSERT, DELETE ON :"schema".outbox_send_budget TO :"relay_role";
GRANT SELECT, INSERT, UPDATE ON :"schema".outbox_send_budget_lock TO :"relay_role";
GRANT SELECT, INSERT ON :"schema".outbox_events TO :"relay_role";
GRANT SELECT, INSERT, UPDATE, DELETE ON :"schema".outbox_suppressions TO :"relay_role";
GRANT SELECT, INSERT ON :"schema".outbox_operator_actions TO :"relay_role";
GRANT SELECT, INSERT, UPDATE ON :"schema".outbox_intakes TO :"relay_role";
GRANT SELECT ON :"schema".outbox_status_summary, :"schema".outbox_lag,
    :"schema".outbox_unknown_outcomes, :"schema".outbox_failures,
    :"schema".outbox_relay_health, :"schema".outbox_delivery_summary,
    :"schema".outbox_event_intake, :"schema".outbox_operator_log
    TO :"relay_role";

-- The app (outbox/enqueue.py): INSERT the message (its pg_notify is allowed to everyone),
-- and SELECT for the existing row's id when the key is a duplicate.
GRANT SELECT, INSERT ON :"schema".outbox_messages TO :"app_role";
