package envd

import (
	"bufio"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
)

// apiError is the JSON error body of every plain HTTP endpoint.
type apiError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeJSONError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, apiError{Code: status, Message: msg})
}

var connectErrWriter = connect.NewErrorWriter()

// writeConnectUnauthenticated answers a Connect call with a protocol-correct
// unauthenticated error.
func writeConnectUnauthenticated(w http.ResponseWriter, r *http.Request) {
	err := connect.NewError(connect.CodeUnauthenticated, errors.New("missing or invalid access token"))
	if connectErrWriter.IsSupported(r) {
		_ = connectErrWriter.Write(w, r, err)
		return
	}
	writeJSONError(w, http.StatusUnauthorized, err.Message())
}

func allowMethods(w http.ResponseWriter, r *http.Request, methods ...string) bool {
	for _, m := range methods {
		if r.Method == m {
			return true
		}
	}
	w.Header().Set("Allow", strings.Join(methods, ", "))
	writeJSONError(w, http.StatusMethodNotAllowed, "method not allowed")
	return false
}

func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodGet, http.MethodHead) {
		return
	}
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusNoContent)
}

// initRequest is the body of POST /init, sent by the host after every boot
// and resume.
type initRequest struct {
	EnvVars        map[string]string `json:"envVars"`
	AccessToken    *string           `json:"accessToken"`
	Timestamp      *time.Time        `json:"timestamp"`
	DefaultUser    *string           `json:"defaultUser"`
	DefaultWorkdir *string           `json:"defaultWorkdir"`
	// EntropySeed (AgentENV's addition, hex) is mixed into the kernel's
	// random pool: sandboxes restored from one snapshot start with the same
	// RNG state, and the host reseeds each one through this field.
	EntropySeed string `json:"entropySeed"`
	// volumeMounts and hyperloopIP exist in E2B's schema; they are accepted
	// and ignored.
}

func (s *Server) handleInit(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodPost) {
		return
	}
	var req initRequest
	body := http.MaxBytesReader(w, r.Body, 8<<20)
	if err := json.NewDecoder(body).Decode(&req); err != nil && !errors.Is(err, io.EOF) {
		writeJSONError(w, http.StatusBadRequest, "invalid JSON body: "+err.Error())
		return
	}

	s.mu.Lock()
	cur := s.accessToken
	// Once a token is set, only a caller that knows it may re-initialise:
	// either in the X-Access-Token header or as the (unchanged) token in the
	// body.
	if cur != "" {
		okHeader := tokenEqual(r.Header.Get("X-Access-Token"), cur)
		okBody := req.AccessToken != nil && tokenEqual(*req.AccessToken, cur)
		if !okHeader && !okBody {
			s.mu.Unlock()
			writeJSONError(w, http.StatusUnauthorized, "access token already set; re-initialisation requires it")
			return
		}
	}
	// A caller allowed to re-initialise may also change the token, or
	// clear it ("": no token, as a sandbox made non-secure from a secure
	// one's snapshot needs).
	if req.AccessToken != nil {
		s.accessToken = *req.AccessToken
	}
	for k, v := range req.EnvVars {
		s.envVars[k] = v
	}
	var userErr error
	if req.DefaultUser != nil && *req.DefaultUser != "" {
		if _, err := lookupUser(*req.DefaultUser); err != nil {
			userErr = err
		} else {
			s.defaultUser = *req.DefaultUser
		}
	}
	if req.DefaultWorkdir != nil {
		s.defaultWorkdir = *req.DefaultWorkdir
	}
	s.mu.Unlock()

	if userErr != nil {
		s.log.Warn("init: default user not applied", "err", userErr)
	}
	if req.Timestamp != nil && !req.Timestamp.IsZero() {
		s.syncClock(*req.Timestamp)
	}
	if req.EntropySeed != "" {
		if err := mixEntropy(req.EntropySeed); err != nil {
			s.log.Warn("init: entropy seed not applied", "err", err)
		}
	}
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusNoContent)
}

// syncClock sets the system clock to host when they differ by more than a
// second. Failure (e.g. not permitted) is logged and otherwise ignored.
func (s *Server) syncClock(host time.Time) {
	drift := time.Since(host)
	if drift < time.Second && drift > -time.Second {
		return
	}
	tv := unix.NsecToTimeval(host.UnixNano())
	if err := unix.Settimeofday(&tv); err != nil {
		s.log.Debug("init: cannot set clock", "err", err, "drift", drift)
		return
	}
	s.log.Info("init: clock adjusted", "drift", drift)
}

func (s *Server) handleEnvs(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodGet) {
		return
	}
	s.mu.RLock()
	out := make(map[string]string, len(s.envVars))
	for k, v := range s.envVars {
		out[k] = v
	}
	s.mu.RUnlock()
	writeJSON(w, http.StatusOK, out)
}

// metrics is the JSON body of GET /metrics (E2B's Metrics schema, plus the
// MiB figures newer E2B versions add).
type metrics struct {
	Timestamp   int64   `json:"ts"`
	CPUCount    int     `json:"cpu_count"`
	CPUUsedPct  float32 `json:"cpu_used_pct"`
	MemTotal    uint64  `json:"mem_total"`
	MemUsed     uint64  `json:"mem_used"`
	MemTotalMiB uint64  `json:"mem_total_mib"`
	MemUsedMiB  uint64  `json:"mem_used_mib"`
	MemCache    uint64  `json:"mem_cache"`
	DiskUsed    uint64  `json:"disk_used"`
	DiskTotal   uint64  `json:"disk_total"`
}

func (s *Server) handleMetrics(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodGet) {
		return
	}
	m := metrics{Timestamp: time.Now().Unix(), CPUCount: runtime.NumCPU()}
	m.CPUUsedPct = float32(cpuSampler.usedPct())
	if total, avail, cached, err := readMeminfo(); err == nil {
		m.MemCache = cached
		m.MemTotal = total
		if avail <= total {
			m.MemUsed = total - avail
		}
		m.MemTotalMiB = m.MemTotal >> 20
		m.MemUsedMiB = m.MemUsed >> 20
	}
	var st unix.Statfs_t
	if err := unix.Statfs("/", &st); err == nil {
		bs := uint64(st.Bsize)
		m.DiskTotal = st.Blocks * bs
		m.DiskUsed = (st.Blocks - st.Bfree) * bs
	}
	writeJSON(w, http.StatusOK, m)
}

func readMeminfo() (total, avail, cached uint64, err error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		v, _ := strconv.ParseUint(fields[1], 10, 64)
		switch fields[0] {
		case "MemTotal:":
			total = v * 1024
		case "MemAvailable:":
			avail = v * 1024
		case "Cached:":
			cached = v * 1024
		}
	}
	return total, avail, cached, sc.Err()
}

// cpuStat samples /proc/stat; usage is computed against the previous call
// (or a short fresh interval the first time).
type cpuStat struct {
	mu         sync.Mutex
	idle, all  uint64
	sampledAt  time.Time
	lastResult float64
}

var cpuSampler = &cpuStat{}

func readCPU() (idle, all uint64, err error) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	line, _, _ := strings.Cut(string(data), "\n")
	fields := strings.Fields(line)
	if len(fields) < 5 || fields[0] != "cpu" {
		return 0, 0, errors.New("unexpected /proc/stat format")
	}
	for i, f := range fields[1:] {
		v, _ := strconv.ParseUint(f, 10, 64)
		all += v
		if i == 3 || i == 4 { // idle, iowait
			idle += v
		}
	}
	return idle, all, nil
}

func (c *cpuStat) usedPct() float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sampledAt.IsZero() || time.Since(c.sampledAt) > time.Minute {
		i, a, err := readCPU()
		if err != nil {
			return 0
		}
		c.idle, c.all, c.sampledAt = i, a, time.Now()
		time.Sleep(100 * time.Millisecond)
	} else if time.Since(c.sampledAt) < 100*time.Millisecond {
		return c.lastResult
	}
	i, a, err := readCPU()
	if err != nil {
		return 0
	}
	di, da := i-c.idle, a-c.all
	c.idle, c.all, c.sampledAt = i, a, time.Now()
	if da == 0 || di > da {
		return c.lastResult
	}
	c.lastResult = float64(da-di) / float64(da) * 100
	return c.lastResult
}

// Ioctls of the kernel's random device (linux/random.h).
const (
	rndAddEntropy = 0x40085203 // _IOW('R', 0x03, int[2])
	rndReseedCRNG = 0x5207     // _IO('R', 0x07)
	maxSeedBytes  = 4096
	minSeedBytes  = 16
)

// mixEntropy adds a hex seed to the kernel's entropy pool and forces the
// CRNG to reseed from it at once, so guests restored from one snapshot stop
// producing the same random numbers. (A plain write to /dev/urandom would
// only take effect at the CRNG's next periodic reseed.)
func mixEntropy(seedHex string) error {
	seed, err := hex.DecodeString(seedHex)
	if err != nil || len(seed) < minSeedBytes || len(seed) > maxSeedBytes {
		return fmt.Errorf("entropySeed must be %d..%d bytes of hex", minSeedBytes, maxSeedBytes)
	}
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	info := make([]byte, 8+len(seed))
	binary.LittleEndian.PutUint32(info[0:], uint32(len(seed)*8))
	binary.LittleEndian.PutUint32(info[4:], uint32(len(seed)))
	copy(info[8:], seed)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), rndAddEntropy, uintptr(unsafe.Pointer(&info[0]))); errno != 0 {
		// Not permitted (not root): mixing without crediting still helps later reseeds.
		_, err := f.Write(seed)
		return errors.Join(fmt.Errorf("RNDADDENTROPY: %w", errno), err)
	}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), rndReseedCRNG, 0); errno != 0 {
		return fmt.Errorf("RNDRESEEDCRNG: %w", errno)
	}
	return nil
}
