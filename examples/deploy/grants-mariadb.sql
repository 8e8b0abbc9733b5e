-- Least-privilege users for sqlalchemy-outbox on MariaDB (and MySQL 8): one for the relay
-- sidecar, one for the host app. Neither can change the schema (no CREATE, ALTER, DROP,
-- INDEX) and neither can delete a message.
--
-- Run it AFTER `outbox-relay migrate` (a table-level GRANT needs the table), as root or the
-- owner of the database. Six placeholders are filled in by envsubst: RELAY_USER,
-- RELAY_PASSWORD, APP_USER, APP_PASSWORD, DB_NAME, and CLIENT_HOST (where the users connect
-- from; % is anywhere). examples/deploy/README.md has the command line.
--
-- The values are pasted into SQL string literals as they are: keep quotes and backslashes
-- out of them. Running it again is safe (the password is set again, the grants are the same).
-- To remove the users: DROP USER '<user>'@'<host>'; for each. An anonymous user
-- (''@'localhost') would take precedence over '<user>'@'%' for local connections: remove it.
--
-- Who may prune: neither user. `outbox-relay prune` deletes finished messages (and their
-- attempts with them), so it runs with the owner's credentials, the same as `migrate`: an
-- occasional job, not the always-on sidecar. A leaked relay or app password can then never
-- erase the delivery history. Operators' status, list, show, requeue and cancel work with
-- the relay role.

CREATE USER IF NOT EXISTS '${RELAY_USER}'@'${CLIENT_HOST}' IDENTIFIED BY '${RELAY_PASSWORD}';
ALTER USER '${RELAY_USER}'@'${CLIENT_HOST}' IDENTIFIED BY '${RELAY_PASSWORD}';
CREATE USER IF NOT EXISTS '${APP_USER}'@'${CLIENT_HOST}' IDENTIFIED BY '${APP_PASSWORD}';
ALTER USER '${APP_USER}'@'${CLIENT_HOST}' IDENTIFIED BY '${APP_PASSWORD}';

-- The relay (relay/store.py); the relay never inserts or deletes a message.
--   outbox_messages: claim (SELECT ... FOR UPDATE SKIP LOCKED, UPDATE, SELECT by claim token),
--     mark_send_started, extend_lease, finalize, retry, fail, hold, release, sweep, expire.
--   outbox_attempts: one INSERT per attempt and per swept send; SELECT for operators' `show`
--     (requeue and cancel add an attempt row too).
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
GRANT SELECT, UPDATE ON `${DB_NAME}`.`outbox_messages` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT ON `${DB_NAME}`.`outbox_attempts` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT, UPDATE ON `${DB_NAME}`.`outbox_relays`
    TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT, DELETE ON `${DB_NAME}`.`outbox_send_budget`
    TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT, UPDATE ON `${DB_NAME}`.`outbox_send_budget_lock`
    TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_status_summary` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_lag` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_unknown_outcomes` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_failures` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_relay_health` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT ON `${DB_NAME}`.`outbox_events` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT, UPDATE, DELETE ON `${DB_NAME}`.`outbox_suppressions`
    TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT ON `${DB_NAME}`.`outbox_operator_actions`
    TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT, UPDATE ON `${DB_NAME}`.`outbox_intakes` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_delivery_summary` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_event_intake` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_operator_log` TO '${RELAY_USER}'@'${CLIENT_HOST}';

-- The app (outbox/enqueue.py): INSERT the message, and SELECT (LOCK IN SHARE MODE) the
-- existing row's id when the key is a duplicate. MySQL before 8.0.22 also wants UPDATE or
-- LOCK TABLES for that locking read; MariaDB and later MySQL do not.
GRANT SELECT, INSERT ON `${DB_NAME}`.`outbox_messages` TO '${APP_USER}'@'${CLIENT_HOST}';
