-- Least-privilege roles for sqlalchemy-outbox on PostgreSQL: the host app, the relay sidecar
-- (`outbox-relay run` and `outbox-relay events`) and, optionally, operators. None can change
-- the schema (no CREATE, ALTER, DROP, TRUNCATE), none can delete a message, and each can update
-- only the columns its own statements write: nobody but the owner rewrites a message's
-- recipients, subject or body.
--
-- Run it AFTER `outbox-relay migrate`, as the owner of the outbox tables (the user `migrate`
-- runs as) or a superuser, connected to the database that holds them. psql binds the values
-- (:"x" quoted as an identifier, :'x' as a string literal), so any password is safe:
--
--   psql "postgresql://owner@db:5432/shop" -v ON_ERROR_STOP=1 \
--        -v relay_role=outbox_relay -v relay_password="$RELAY_PASSWORD" \
--        -v app_role=outbox_app -v app_password="$APP_PASSWORD" \
--        -v operator_role=outbox_operator -v operator_password="$OPERATOR_PASSWORD" \
--        -f grants-postgresql.sql
--
-- operator_role is optional (without it, operators use the owner). -v schema=NAME when the
-- outbox tables are not in schema public. The database granted CONNECT is the one psql is
-- connected to. Running it again is safe, and tightens roles an older version of this script
-- made: each role's privileges on the outbox tables and views are revoked and granted again,
-- and its password set again. Make these roles for the outbox only: never give the owner's
-- role, nor one your app uses for its own tables with a schema-wide grant. To remove them:
--   DROP OWNED BY outbox_relay, outbox_app, outbox_operator;
--   DROP ROLE outbox_relay, outbox_app, outbox_operator;
--
-- Who may prune: the owner. `outbox-relay prune` deletes finished messages with their
-- attempts and events, so it runs with the owner's credentials, the same as `migrate`: a leaked
-- relay, app or operator password can never erase the delivery history.
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
\if :{?operator_role}
\else
\set operator_role ''
\set operator_password ''
\endif
SELECT :'operator_role' <> '' AS with_operator \gset

SELECT format('CREATE ROLE %I LOGIN', name)
  FROM unnest(ARRAY[:'relay_role', :'app_role', :'operator_role']) AS name
 WHERE name <> '' AND NOT EXISTS (SELECT FROM pg_roles WHERE rolname = name) \gexec
ALTER ROLE :"relay_role" LOGIN PASSWORD :'relay_password';
ALTER ROLE :"app_role" LOGIN PASSWORD :'app_password';
\if :with_operator
ALTER ROLE :"operator_role" LOGIN PASSWORD :'operator_password';
\endif

-- Start from nothing on every outbox table and view (a role made by an older version of this
-- script had more); the roles' privileges elsewhere are left alone.
SELECT format('REVOKE ALL ON TABLE %I.%I FROM %I', n.nspname, c.relname, r.rolname)
  FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace
  JOIN pg_roles r ON r.rolname IN (:'relay_role', :'app_role', :'operator_role')
 WHERE n.nspname = :'schema' AND c.relkind IN ('r', 'p', 'v') AND c.relname LIKE 'outbox\_%'
\gexec

GRANT CONNECT ON DATABASE :"DBNAME" TO :"relay_role", :"app_role";
GRANT USAGE ON SCHEMA :"schema" TO :"relay_role", :"app_role";

-- The app (outbox/enqueue.py): one INSERT of the columns a new row carries (with pg_notify,
-- which every role may call), ON CONFLICT on the idempotency key, RETURNING the ids; a
-- duplicate key's id is read back by key; a keyed message's turn follows the latest turn of
-- its key's pending rows (outbox/fairness.py). It reads no body or recipient.
GRANT INSERT (idempotency_key, category, priority, status, payload, recipients,
    recipient_count, subject, attempt_count, max_attempts, backoff_base, backoff_cap,
    ambiguity_policy, reconcile_after, next_attempt_at, expires_at, created_at, updated_at,
    fairness_key, fair_at, line_at)
    ON :"schema".outbox_messages TO :"app_role";
GRANT SELECT (id, idempotency_key, status, priority, fairness_key, line_at)
    ON :"schema".outbox_messages TO :"app_role";

-- The relay: `run` (relay/store.py) and `events` (relay/intake.py). Identity columns need no
-- grant on their sequences, and LISTEN needs none either.
--   outbox_messages: reads rows to send them; updates only the delivery columns of the claim,
--     mark, lease, finalize, retry, hold, release, sweep, expire and reconcile statements,
--     and the intake's resolve and delivery status. It never inserts or deletes a message,
--     nor changes what it says (key, category, priority, recipients, subject, payload) or
--     how it is retried (attempt budget, backoff, ambiguity policy, expiry).
--   outbox_attempts: one INSERT per attempt, swept send, reconcile and resolve.
--   outbox_relays: register (INSERT, or take over a dead relay's row), heartbeat (with the
--     relay's scoped pauses, paused_scopes) and stop.
--   outbox_send_budget, outbox_send_budget_lock: with --max-send-rate, --key-limit or
--     --identity-limit, every send is booked (INSERT) under the lock row (UPDATE; INSERT puts
--     it back if it is missing); bookings that ended are deleted.
--   outbox_send_slots: with a limit of sends in flight, one row per send (INSERT), deleted
--     once its send is no longer in flight.
--   outbox_events: the intake records each event once (INSERT) and sets what it did (effect).
--   outbox_suppressions: the intake adds bounced and complaining addresses, each send reads
--     them; only operators remove one.
--   outbox_intakes: each intake replica's row (INSERT ... ON CONFLICT DO UPDATE).
--   outbox_operator_actions and the views: read only (/metrics reads outbox_lag and
--     outbox_delivery_summary; the schema check looks for every outbox table).
--   A retry, a release or a requeue moves a row's turn (fair_at) with its due time.
GRANT SELECT ON :"schema".outbox_messages, :"schema".outbox_attempts, :"schema".outbox_relays,
    :"schema".outbox_send_budget, :"schema".outbox_send_budget_lock, :"schema".outbox_events,
    :"schema".outbox_suppressions, :"schema".outbox_intakes, :"schema".outbox_operator_actions,
    :"schema".outbox_send_slots,
    :"schema".outbox_status_summary, :"schema".outbox_lag, :"schema".outbox_unknown_outcomes,
    :"schema".outbox_failures, :"schema".outbox_relay_health, :"schema".outbox_delivery_summary,
    :"schema".outbox_event_intake, :"schema".outbox_fairness
    TO :"relay_role";
GRANT UPDATE (status, claim_token, claimed_by, claimed_at, lease_expires_at, send_started_at,
    attempt_count, next_attempt_at, last_attempt_at, last_error_code, last_error_message,
    sent_at, provider_message_id, delivery_status, delivery_status_at, updated_at, fair_at)
    ON :"schema".outbox_messages TO :"relay_role";
GRANT INSERT ON :"schema".outbox_attempts, :"schema".outbox_relays, :"schema".outbox_send_budget,
    :"schema".outbox_send_budget_lock, :"schema".outbox_events, :"schema".outbox_suppressions,
    :"schema".outbox_intakes, :"schema".outbox_send_slots
    TO :"relay_role";
GRANT UPDATE (host, pid, started_at, heartbeat_at, state, paused_scopes)
    ON :"schema".outbox_relays TO :"relay_role";
GRANT UPDATE (id) ON :"schema".outbox_send_budget_lock TO :"relay_role";
GRANT DELETE ON :"schema".outbox_send_budget, :"schema".outbox_send_slots TO :"relay_role";
GRANT UPDATE (effect) ON :"schema".outbox_events TO :"relay_role";
GRANT UPDATE (queue_url, visibility_timeout, started_at, heartbeat_at, caught_up_at)
    ON :"schema".outbox_intakes TO :"relay_role";

\if :with_operator
GRANT CONNECT ON DATABASE :"DBNAME" TO :"operator_role";
GRANT USAGE ON SCHEMA :"schema" TO :"operator_role";
-- Operators (relay/admin.py): status, list and show read everything; requeue, cancel and
-- resolve move a message (status, attempt budget, schedule, claim, sent, provider id) and add
-- an attempt row; suppressions add, import and remove change the list. Each writes its line
-- of outbox_operator_actions, which nobody but the owner edits or deletes. The locking read
-- of the suppressions an operator changes (FOR UPDATE) needs an UPDATE privilege: on
-- `detail`, which operators may as well delete and insert again.
GRANT SELECT ON :"schema".outbox_messages, :"schema".outbox_attempts, :"schema".outbox_relays,
    :"schema".outbox_send_budget, :"schema".outbox_send_budget_lock, :"schema".outbox_events,
    :"schema".outbox_suppressions, :"schema".outbox_intakes, :"schema".outbox_operator_actions,
    :"schema".outbox_status_summary, :"schema".outbox_lag, :"schema".outbox_unknown_outcomes,
    :"schema".outbox_failures, :"schema".outbox_relay_health, :"schema".outbox_delivery_summary,
    :"schema".outbox_event_intake, :"schema".outbox_operator_log, :"schema".outbox_send_slots,
    :"schema".outbox_fairness
    TO :"operator_role";
GRANT UPDATE (status, claim_token, lease_expires_at, send_started_at, attempt_count,
    next_attempt_at, sent_at, provider_message_id, updated_at, fair_at)
    ON :"schema".outbox_messages TO :"operator_role";
GRANT INSERT ON :"schema".outbox_attempts, :"schema".outbox_operator_actions
    TO :"operator_role";
GRANT INSERT, DELETE, UPDATE (detail) ON :"schema".outbox_suppressions TO :"operator_role";
\endif
