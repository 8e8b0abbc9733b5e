-- Least-privilege users for sqlalchemy-outbox on MariaDB (and MySQL 8): the host app, the
-- relay sidecar (`outbox-relay run` and `outbox-relay events`) and operators. None can change
-- the schema (no CREATE, ALTER, DROP, INDEX), none can delete a message, and each can update
-- only the columns its own statements write: nobody but the owner rewrites a message's
-- recipients, subject or body. What each grant is for: grants-postgresql.sql, grant by grant.
--
-- Run it AFTER `outbox-relay migrate` (a table-level GRANT needs the table), as root or the
-- owner of the database. envsubst fills in the placeholders: RELAY_USER, APP_USER,
-- OPERATOR_USER, DB_NAME and CLIENT_HOST (where the users connect from; % is anywhere), pasted
-- as they are (names you choose: letters, digits, _), and RELAY_PASSWORD_B64,
-- APP_PASSWORD_B64 and OPERATOR_PASSWORD_B64, each password in base64 (its bytes through
-- `base64 -w0`, no newline added). Base64 has no quote, backslash or semicolon:
-- the server decodes each password into a variable and quotes it itself (QUOTE), so a password
-- is never SQL. An empty or malformed one stops the script before any user is made.
-- examples/deploy/README.md has the command line.
--
-- Running it again is safe (the passwords are set again, the grants are the same). It does
-- not revoke what an older version of this script granted: first run, for each user,
-- REVOKE ALL PRIVILEGES, GRANT OPTION FROM '<user>'@'<host>'; (it keeps the user and its
-- password). To remove the users: DROP USER '<user>'@'<host>'; for each. An anonymous user
-- (''@'localhost') would take precedence over '<user>'@'%' for local connections: remove it.
--
-- Who may prune: the owner. `outbox-relay prune` deletes finished messages with their
-- attempts and events, so it runs with the owner's credentials, the same as `migrate`: a
-- leaked relay, app or operator password can never erase the delivery history.

-- Each name checked before anything is made: read once (backslashes kept as they are), then
-- refused, naming its placeholder, if empty or holding what would end the quotes it is pasted
-- in. Why: an unset variable is pasted as '' (''@'%' is the anonymous user) and a backtick in
-- DB_NAME ends the identifier (GRANT ... ON *.*). A name that ends this first literal with a
-- quote is still read as SQL: the names must be ones you chose.
SET SESSION sql_mode = 'STRICT_ALL_TABLES,NO_BACKSLASH_ESCAPES';
-- ^[^'`\\[:cntrl:]]+\z, its backslashes made by CHAR(): a quote in a name leaves the ones in
-- the text outside a string, where the client reads them as its commands
SET @outbox_pattern = CONCAT('^[^''`', CHAR(92, 92 USING ascii), '[:cntrl:]]+',
    CHAR(92 USING ascii), 'z');
SET @outbox_name = '${CLIENT_HOST}', @outbox_check = 'CLIENT_HOST';
SET SESSION sql_mode = IF(@outbox_name REGEXP @outbox_pattern, @@SESSION.sql_mode,
    'CLIENT_HOST refused: empty or holding a quote or backtick or backslash or control character');
SET @outbox_name = '${RELAY_USER}', @outbox_check = 'RELAY_USER';
SET SESSION sql_mode = IF(@outbox_name REGEXP @outbox_pattern, @@SESSION.sql_mode,
    'RELAY_USER refused: empty or holding a quote or backtick or backslash or control character');
SET @outbox_name = '${APP_USER}', @outbox_check = 'APP_USER';
SET SESSION sql_mode = IF(@outbox_name REGEXP @outbox_pattern, @@SESSION.sql_mode,
    'APP_USER refused: empty or holding a quote or backtick or backslash or control character');
SET @outbox_name = '${OPERATOR_USER}', @outbox_check = 'OPERATOR_USER';
SET SESSION sql_mode = IF(@outbox_name REGEXP @outbox_pattern, @@SESSION.sql_mode,
    'OPERATOR_USER refused: empty or holding a quote or backtick or backslash or control character');
SET @outbox_name = '${DB_NAME}', @outbox_check = 'DB_NAME';
SET SESSION sql_mode = IF(@outbox_name REGEXP @outbox_pattern, @@SESSION.sql_mode,
    'DB_NAME refused: empty or holding a quote or backtick or backslash or control character');
SET @outbox_name = NULL, @outbox_check = NULL, @outbox_pattern = NULL;

-- QUOTE() escapes with backslashes: they must mean escapes in this session
SET SESSION sql_mode = 'STRICT_ALL_TABLES';
SET @outbox_host = '${CLIENT_HOST}';

SET @outbox_user = '${RELAY_USER}';
SET @outbox_password = CONVERT(FROM_BASE64('${RELAY_PASSWORD_B64}') USING utf8mb4);
SET @outbox_account = CONCAT(QUOTE(@outbox_user), '@', QUOTE(@outbox_host), ' IDENTIFIED BY ',
    IF(LENGTH(@outbox_password) > 0, QUOTE(@outbox_password), 'RELAY_PASSWORD_B64_bad_base64'));
PREPARE outbox_user FROM CONCAT('CREATE USER IF NOT EXISTS ', @outbox_account);
EXECUTE outbox_user;
PREPARE outbox_user FROM CONCAT('ALTER USER ', @outbox_account);
EXECUTE outbox_user;

SET @outbox_user = '${APP_USER}';
SET @outbox_password = CONVERT(FROM_BASE64('${APP_PASSWORD_B64}') USING utf8mb4);
SET @outbox_account = CONCAT(QUOTE(@outbox_user), '@', QUOTE(@outbox_host), ' IDENTIFIED BY ',
    IF(LENGTH(@outbox_password) > 0, QUOTE(@outbox_password), 'APP_PASSWORD_B64_bad_base64'));
PREPARE outbox_user FROM CONCAT('CREATE USER IF NOT EXISTS ', @outbox_account);
EXECUTE outbox_user;
PREPARE outbox_user FROM CONCAT('ALTER USER ', @outbox_account);
EXECUTE outbox_user;

SET @outbox_user = '${OPERATOR_USER}';
SET @outbox_password = CONVERT(FROM_BASE64('${OPERATOR_PASSWORD_B64}') USING utf8mb4);
SET @outbox_account = CONCAT(QUOTE(@outbox_user), '@', QUOTE(@outbox_host), ' IDENTIFIED BY ',
    IF(LENGTH(@outbox_password) > 0, QUOTE(@outbox_password), 'OPERATOR_PASSWORD_B64_bad_base64'));
PREPARE outbox_user FROM CONCAT('CREATE USER IF NOT EXISTS ', @outbox_account);
EXECUTE outbox_user;
PREPARE outbox_user FROM CONCAT('ALTER USER ', @outbox_account);
EXECUTE outbox_user;

DEALLOCATE PREPARE outbox_user;
SET @outbox_password = NULL, @outbox_account = NULL;

-- The app (outbox/enqueue.py): INSERT of the columns a new row carries, under GET_LOCK (no
-- grant needed); a duplicate key's id is read back by key (LOCK IN SHARE MODE). MySQL before
-- 8.0.22 also wants UPDATE or LOCK TABLES for that locking read; MariaDB and later MySQL do not.
-- A keyed message's turn follows the latest turn of its key's pending rows (outbox/fairness.py).
GRANT INSERT (idempotency_key, category, priority, status, payload, recipients,
    recipient_count, subject, attempt_count, max_attempts, backoff_base, backoff_cap,
    ambiguity_policy, reconcile_after, next_attempt_at, expires_at, created_at, updated_at,
    fairness_key, fair_at, line_at),
    SELECT (id, idempotency_key, status, priority, fairness_key, line_at)
    ON `${DB_NAME}`.`outbox_messages` TO '${APP_USER}'@'${CLIENT_HOST}';

-- The relay: `run` (relay/store.py) and `events` (relay/intake.py). It reads every outbox
-- table (the schema check must see each one: MariaDB lists only the tables a user has a
-- privilege on) and the views, and writes only these:
GRANT SELECT, UPDATE (status, claim_token, claimed_by, claimed_at, lease_expires_at,
    send_started_at, attempt_count, next_attempt_at, last_attempt_at, last_error_code,
    last_error_message, sent_at, provider_message_id, delivery_status, delivery_status_at,
    updated_at, fair_at)
    ON `${DB_NAME}`.`outbox_messages` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT ON `${DB_NAME}`.`outbox_attempts` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT, UPDATE (host, pid, started_at, heartbeat_at, state, paused_scopes)
    ON `${DB_NAME}`.`outbox_relays` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT, DELETE ON `${DB_NAME}`.`outbox_send_budget`
    TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT, UPDATE (id) ON `${DB_NAME}`.`outbox_send_budget_lock`
    TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT, DELETE ON `${DB_NAME}`.`outbox_send_slots`
    TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT, UPDATE (effect) ON `${DB_NAME}`.`outbox_events`
    TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT ON `${DB_NAME}`.`outbox_suppressions` TO '${RELAY_USER}'@'${CLIENT_HOST}';
-- (INSERT ... ON DUPLICATE KEY UPDATE wants UPDATE on every column it inserts, the key too)
GRANT SELECT, INSERT, UPDATE ON `${DB_NAME}`.`outbox_intakes` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_operator_actions` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_status_summary` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_lag` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_unknown_outcomes` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_failures` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_relay_health` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_delivery_summary` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_event_intake` TO '${RELAY_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_fairness` TO '${RELAY_USER}'@'${CLIENT_HOST}';

-- Operators (relay/admin.py): read everything; requeue, cancel and resolve move a message and
-- add an attempt row; suppressions add, import and remove; each writes its log line.
GRANT SELECT, UPDATE (status, claim_token, lease_expires_at, send_started_at, attempt_count,
    next_attempt_at, sent_at, provider_message_id, updated_at, fair_at)
    ON `${DB_NAME}`.`outbox_messages` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT ON `${DB_NAME}`.`outbox_attempts` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT ON `${DB_NAME}`.`outbox_operator_actions`
    TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT, INSERT, DELETE ON `${DB_NAME}`.`outbox_suppressions`
    TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_relays` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_send_budget` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_send_budget_lock` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_events` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_intakes` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_status_summary` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_lag` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_unknown_outcomes` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_failures` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_relay_health` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_delivery_summary` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_event_intake` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_operator_log` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_send_slots` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
GRANT SELECT ON `${DB_NAME}`.`outbox_fairness` TO '${OPERATOR_USER}'@'${CLIENT_HOST}';
