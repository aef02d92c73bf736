package orchestrator

import (
	"database/sql"
	"path/filepath"
	"testing"

	"github.com/agentenv/agentenv/internal/statedb"
)

// TestMigratesOldDatabase opens a state database made by the first release
// (without the later columns) and checks the node can read it.
func TestMigratesOldDatabase(t *testing.T) {
	path := filepath.Join(t.TempDir(), "aenv.db")
	old, err := sql.Open("sqlite", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := old.Exec(`CREATE TABLE sandboxes (id TEXT PRIMARY KEY, template_id TEXT NOT NULL, state TEXT NOT NULL,
		vcpus INTEGER NOT NULL, memory_mib INTEGER NOT NULL, disk_mib INTEGER NOT NULL, slot INTEGER NOT NULL UNIQUE,
		pid INTEGER NOT NULL DEFAULT 0, allow_internet INTEGER NOT NULL, secure INTEGER NOT NULL, auto_pause INTEGER NOT NULL,
		access_token TEXT NOT NULL, traffic_token TEXT NOT NULL, default_user TEXT NOT NULL, metadata TEXT NOT NULL,
		env_vars TEXT NOT NULL, created_at INTEGER NOT NULL, started_at INTEGER NOT NULL, end_at INTEGER NOT NULL,
		updated_at INTEGER NOT NULL);
		INSERT INTO sandboxes VALUES ('old1', 'base', 'paused', 2, 512, 0, 3, 0, 1, 1, 1, 'tok', 'tt', 'user', '{"a":"b"}', '{}', 1, 2, 3, 4);`); err != nil {
		t.Fatal(err)
	}
	old.Close()
	db, err := statedb.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := migrateSandboxes(db); err != nil {
		t.Fatal(err)
	}
	n := &Node{db: db}
	s, err := n.loadSandbox(t.Context(), "old1")
	if err != nil {
		t.Fatal(err)
	}
	if s.State != StatePaused || s.Metadata["a"] != "b" || !s.PublicTraffic || s.AutoResume || s.MemFile != "" {
		t.Fatalf("migrated row %+v", s)
	}
}
