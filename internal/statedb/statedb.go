// Package statedb opens a node's embedded SQLite database (one file in the
// data dir, WAL, synchronous writes, foreign keys on). The packages that
// keep records in it own their tables and create them themselves; one
// database lets a record and the references it holds be written in one
// transaction.
package statedb

import (
	"database/sql"
	"fmt"

	_ "modernc.org/sqlite" // registers the "sqlite" driver
)

// FileName is the database's file in a data dir.
const FileName = "aenv.db"

// Open opens (creating) the database at path. One connection: SQLite
// serializes writers anyway, and a transaction then excludes every other
// statement of the process until it ends (callers must not use the *sql.DB
// while they hold a transaction).
func Open(path string) (*sql.DB, error) {
	return open(path, "file:"+path+"?_pragma=journal_mode(WAL)&_pragma=synchronous(FULL)&_pragma=busy_timeout(5000)&_pragma=foreign_keys(ON)")
}

// OpenReadOnly opens the database at path for reading only (offline
// commands reading a data dir a server may be using).
func OpenReadOnly(path string) (*sql.DB, error) {
	return open(path, "file:"+path+"?mode=ro&_pragma=busy_timeout(5000)")
}

func open(path, dsn string) (*sql.DB, error) {
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("open state db %s: %w", path, err)
	}
	db.SetMaxOpenConns(1)
	if err := db.Ping(); err != nil {
		db.Close()
		return nil, fmt.Errorf("open state db %s: %w", path, err)
	}
	return db, nil
}

// Columns lists the columns of table.
func Columns(db *sql.DB, table string) (map[string]bool, error) {
	rows, err := db.Query(`SELECT name FROM pragma_table_info(?)`, table)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	have := map[string]bool{}
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			return nil, err
		}
		have[n] = true
	}
	return have, rows.Err()
}

// Collect reads every row of a query (rows, err as QueryContext returns
// them) with scan, and closes the rows.
func Collect[T any](rows *sql.Rows, err error, scan func(interface{ Scan(...any) error }) (T, error)) ([]T, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []T
	for rows.Next() {
		v, err := scan(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, rows.Err()
}
