// Package deploy checks the deployment files in deploy/: the Kubernetes
// manifests parsed strictly with the Kubernetes API types, the Compose
// file, the systemd units and the install script. No cluster, Docker daemon
// or systemd runs here, so the checks are of the files themselves and of
// every aenv command line in them against the real binary's flags.
package deploy

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	"go.yaml.in/yaml/v3"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	sigsyaml "sigs.k8s.io/yaml"

	"github.com/agentenv/agentenv/internal/storage/repository"
)

const deployDir = "../../deploy"

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// aenv builds the aenv binary once.
func aenv(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		dir, err := os.MkdirTemp("", "aenv-deploy-test-")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "aenv")
		out, err := exec.Command("go", "build", "-C", "../..", "-o", binPath, "./cmd/aenv").CombinedOutput()
		if err != nil {
			binErr = &buildError{out: string(out), err: err}
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

type buildError struct {
	out string
	err error
}

func (e *buildError) Error() string { return e.err.Error() + ": " + e.out }

// checkArgs runs `aenv <args> --help`: cobra parses every flag first, so an
// unknown flag or a bad value fails here as it would in the deployment.
func checkArgs(t *testing.T, args []string) {
	t.Helper()
	if len(args) == 0 {
		t.Fatal("no aenv arguments")
	}
	out, err := exec.Command(aenv(t), append(slices.Clone(args), "--help")...).CombinedOutput()
	if err != nil {
		t.Fatalf("aenv %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	if !bytes.Contains(out, []byte("Usage:")) {
		t.Fatalf("aenv %s --help printed no usage:\n%s", strings.Join(args, " "), out)
	}
}

// flagValue returns the value after flag in args.
func flagValue(args []string, flag string) string {
	for i, a := range args {
		if a == flag && i+1 < len(args) {
			return args[i+1]
		}
	}
	return ""
}

// k8sObjects holds the manifests by kind and name.
type k8sObjects struct {
	namespaces  map[string]*corev1.Namespace
	configMaps  map[string]*corev1.ConfigMap
	secrets     map[string]*corev1.Secret
	services    map[string]*corev1.Service
	deployments map[string]*appsv1.Deployment
	daemonSets  map[string]*appsv1.DaemonSet
}

func loadManifests(t *testing.T) *k8sObjects {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(deployDir, "kubernetes", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests: %v", err)
	}
	o := &k8sObjects{map[string]*corev1.Namespace{}, map[string]*corev1.ConfigMap{}, map[string]*corev1.Secret{},
		map[string]*corev1.Service{}, map[string]*appsv1.Deployment{}, map[string]*appsv1.DaemonSet{}}
	docSep := regexp.MustCompile(`(?m)^---\s*$`)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range docSep.Split(string(b), -1) {
			if strings.TrimSpace(stripComments(doc)) == "" {
				continue
			}
			var tm metav1.TypeMeta
			if err := sigsyaml.Unmarshal([]byte(doc), &tm); err != nil {
				t.Fatalf("%s #%d: %v", f, i, err)
			}
			var obj interface{ GetName() string }
			var into any
			switch tm.APIVersion + "/" + tm.Kind {
			case "v1/Namespace":
				v := &corev1.Namespace{}
				obj, into = v, v
			case "v1/ConfigMap":
				v := &corev1.ConfigMap{}
				obj, into = v, v
			case "v1/Secret":
				v := &corev1.Secret{}
				obj, into = v, v
			case "v1/Service":
				v := &corev1.Service{}
				obj, into = v, v
			case "apps/v1/Deployment":
				v := &appsv1.Deployment{}
				obj, into = v, v
			case "apps/v1/DaemonSet":
				v := &appsv1.DaemonSet{}
				obj, into = v, v
			default:
				t.Fatalf("%s #%d: unexpected kind %s/%s", f, i, tm.APIVersion, tm.Kind)
			}
			// Strict: an unknown or misspelt field is an error.
			if err := sigsyaml.UnmarshalStrict([]byte(doc), into); err != nil {
				t.Fatalf("%s #%d (%s): %v", f, i, tm.Kind, err)
			}
			if obj.GetName() == "" {
				t.Fatalf("%s #%d: %s without a name", f, i, tm.Kind)
			}
			switch v := into.(type) {
			case *corev1.Namespace:
				o.namespaces[v.Name] = v
			case *corev1.ConfigMap:
				o.configMaps[v.Name] = v
			case *corev1.Secret:
				o.secrets[v.Name] = v
			case *corev1.Service:
				o.services[v.Name] = v
			case *appsv1.Deployment:
				o.deployments[v.Name] = v
			case *appsv1.DaemonSet:
				o.daemonSets[v.Name] = v
			}
		}
	}
	return o
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// expandArgs substitutes $(VAR) as the kubelet does, from plain values,
// ConfigMap keys and placeholders for field references.
func expandArgs(t *testing.T, o *k8sObjects, c corev1.Container) []string {
	t.Helper()
	vals := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			vals[e.Name] = e.Value
		case e.ValueFrom.ConfigMapKeyRef != nil:
			ref := e.ValueFrom.ConfigMapKeyRef
			cm, ok := o.configMaps[ref.Name]
			if !ok {
				t.Fatalf("container %s: env %s names ConfigMap %s, which no manifest has", c.Name, e.Name, ref.Name)
			}
			v, ok := cm.Data[ref.Key]
			if !ok {
				t.Fatalf("container %s: env %s names key %s, not in ConfigMap %s", c.Name, e.Name, ref.Key, ref.Name)
			}
			vals[e.Name] = v
		case e.ValueFrom.SecretKeyRef != nil:
			ref := e.ValueFrom.SecretKeyRef
			s, ok := o.secrets[ref.Name]
			if !ok {
				t.Fatalf("container %s: env %s names Secret %s, which no manifest has", c.Name, e.Name, ref.Name)
			}
			v, ok := s.StringData[ref.Key]
			if !ok {
				t.Fatalf("container %s: env %s names key %s, not in Secret %s", c.Name, e.Name, ref.Key, ref.Name)
			}
			vals[e.Name] = v
		case e.ValueFrom.FieldRef != nil:
			switch e.ValueFrom.FieldRef.FieldPath {
			case "status.podIP":
				vals[e.Name] = "10.1.2.3"
			case "spec.nodeName":
				vals[e.Name] = "worker-1"
			default:
				t.Fatalf("container %s: env %s: unexpected field %s", c.Name, e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
		}
	}
	ref := regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)
	var out []string
	for _, a := range c.Args {
		out = append(out, ref.ReplaceAllStringFunc(a, func(m string) string {
			name := ref.FindStringSubmatch(m)[1]
			v, ok := vals[name]
			if !ok {
				t.Fatalf("container %s: argument %q uses $(%s), which is not in its env", c.Name, a, name)
			}
			return v
		}))
	}
	return out
}

// TestKubernetesManifests parses every manifest with the Kubernetes API
// types (strictly) and checks what the deployment needs.
func TestKubernetesManifests(t *testing.T) {
	o := loadManifests(t)
	if _, ok := o.namespaces["agentenv"]; !ok {
		t.Fatal("no agentenv Namespace")
	}
	key := o.secrets["aenv-secrets"]
	if key == nil || !regexp.MustCompile(`^e2b_[0-9a-f]+$`).MatchString(key.StringData["AENV_API_KEY"]) {
		t.Fatal("the aenv-secrets Secret lacks an e2b_<hex> AENV_API_KEY")
	}
	if _, err := repository.ParseURL(o.configMaps["aenv-config"].Data["REPOSITORY"]); err != nil {
		t.Fatalf("REPOSITORY in the ConfigMap: %v", err)
	}

	type workload struct {
		name   string
		labels map[string]string
		pod    corev1.PodSpec
		role   string
	}
	var workloads []workload
	for _, want := range []struct{ name, role string }{{"aenv-scheduler", "scheduler"}, {"aenv-gateway", "gateway"}} {
		d, ok := o.deployments[want.name]
		if !ok {
			t.Fatalf("no Deployment %s", want.name)
		}
		workloads = append(workloads, workload{d.Name, d.Spec.Template.Labels, d.Spec.Template.Spec, want.role})
		if sel, _ := metav1.LabelSelectorAsMap(d.Spec.Selector); !subset(sel, d.Spec.Template.Labels) {
			t.Fatalf("%s: selector %v does not match its pods %v", d.Name, sel, d.Spec.Template.Labels)
		}
	}
	ds, ok := o.daemonSets["aenv-node"]
	if !ok {
		t.Fatal("no node DaemonSet")
	}
	if sel, _ := metav1.LabelSelectorAsMap(ds.Spec.Selector); !subset(sel, ds.Spec.Template.Labels) {
		t.Fatalf("node DaemonSet: selector %v does not match its pods", sel)
	}
	workloads = append(workloads, workload{ds.Name, ds.Spec.Template.Labels, ds.Spec.Template.Spec, "node"})

	for _, w := range workloads {
		t.Run(w.name, func(t *testing.T) {
			if len(w.pod.Containers) != 1 {
				t.Fatalf("%d containers", len(w.pod.Containers))
			}
			c := w.pod.Containers[0]
			args := expandArgs(t, o, c)
			if args[0] != w.role {
				t.Fatalf("runs aenv %s, want %s", args[0], w.role)
			}
			checkArgs(t, args)
			hasKey := false
			for _, e := range c.Env {
				if e.Name == "AENV_API_KEY" && e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
					hasKey = true
				}
			}
			if !hasKey {
				t.Fatal("AENV_API_KEY does not come from the Secret")
			}
			if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/health" {
				t.Fatal("no /health readiness probe")
			}
			if w.role == "node" {
				checkNodePod(t, o, w.pod, args)
			} else if c.SecurityContext == nil || c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged {
				t.Fatal("the scheduler and the gateway need no privileges")
			}
		})
	}

	// Every Service selects the pods of one workload and targets a port
	// their container has.
	for _, svc := range o.services {
		var match []workload
		for _, w := range workloads {
			if subset(svc.Spec.Selector, w.labels) {
				match = append(match, w)
			}
		}
		if len(match) != 1 {
			t.Fatalf("Service %s selects %d workloads", svc.Name, len(match))
		}
		for _, p := range svc.Spec.Ports {
			if !hasPort(match[0].pod.Containers[0], p.TargetPort) {
				t.Fatalf("Service %s: target port %s is not a port of %s", svc.Name, p.TargetPort.String(), match[0].name)
			}
		}
	}
	sched := o.configMaps["aenv-config"].Data["SCHEDULER_URL"]
	if !strings.HasPrefix(sched, "http://aenv-scheduler.") || !strings.HasSuffix(sched, ":9090") {
		t.Fatalf("SCHEDULER_URL %q does not name the scheduler Service", sched)
	}
}

func checkNodePod(t *testing.T, o *k8sObjects, pod corev1.PodSpec, args []string) {
	t.Helper()
	c := pod.Containers[0]
	if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
		t.Fatal("the node must be privileged (network namespaces, taps, nftables)")
	}
	vols := map[string]corev1.Volume{}
	for _, v := range pod.Volumes {
		vols[v.Name] = v
	}
	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		if _, ok := vols[m.Name]; !ok {
			t.Fatalf("mount of undeclared volume %s", m.Name)
		}
		mounts[m.MountPath] = m.Name
	}
	for path, want := range map[string]string{"/dev/kvm": "/dev/kvm", "/var/lib/aenv": "/var/lib/aenv", "/dev/net/tun": "/dev/net/tun"} {
		v, ok := vols[mounts[path]]
		if !ok || v.HostPath == nil || v.HostPath.Path != want {
			t.Fatalf("%s is not mounted from the host's %s", path, want)
		}
	}
	if mounts["/etc/aenv/s3"] == "" || vols[mounts["/etc/aenv/s3"]].Secret == nil {
		t.Fatal("the S3 credentials are not mounted from the Secret")
	}
	repo := flagValue(args, "--repository")
	cfg, err := repository.ParseURL(repo)
	if err != nil {
		t.Fatalf("--repository %q: %v", repo, err)
	}
	if cfg.Backend != repository.BackendOSS || !strings.HasPrefix(cfg.OSS.CredentialsFile, "/etc/aenv/s3/") {
		t.Fatalf("the repository's credentials file %+v is not the mounted Secret", cfg.OSS)
	}
	if flagValue(args, "--advertise-url") != "http://10.1.2.3:8000" {
		t.Fatalf("the node advertises %q, not its pod IP", flagValue(args, "--advertise-url"))
	}
}

func subset(sel, labels map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func hasPort(c corev1.Container, p intstr.IntOrString) bool {
	for _, cp := range c.Ports {
		if (p.Type == intstr.String && cp.Name == p.StrVal) || (p.Type == intstr.Int && cp.ContainerPort == p.IntVal) {
			return true
		}
	}
	return false
}

// TestComposeFile checks the Compose cluster: scheduler, gateway, two
// privileged nodes and an S3 store, every aenv command line valid.
func TestComposeFile(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(deployDir, "compose", "docker-compose.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Services map[string]struct {
			Image       string            `yaml:"image"`
			Command     []string          `yaml:"command"`
			Privileged  bool              `yaml:"privileged"`
			Environment map[string]string `yaml:"environment"`
			Volumes     []string          `yaml:"volumes"`
			Ports       []string          `yaml:"ports"`
			Build       *struct {
				Context    string `yaml:"context"`
				Dockerfile string `yaml:"dockerfile"`
			} `yaml:"build"`
		} `yaml:"services"`
	}
	if err := yaml.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"s3", "scheduler", "gateway", "node1", "node2"} {
		if _, ok := f.Services[name]; !ok {
			t.Fatalf("no %s service", name)
		}
	}
	for name, s := range f.Services {
		if name == "s3" {
			continue
		}
		if s.Build == nil || filepath.Join("deploy/compose", s.Build.Context, s.Build.Dockerfile) != "deploy/docker/Dockerfile" {
			t.Fatalf("%s does not build deploy/docker/Dockerfile", name)
		}
		if s.Environment["AENV_API_KEY"] == "" {
			t.Fatalf("%s has no AENV_API_KEY", name)
		}
		if s.Command[0] != strings.TrimRight(name, "12") {
			t.Fatalf("%s runs aenv %s", name, s.Command[0])
		}
		checkArgs(t, s.Command)
		if strings.HasPrefix(name, "node") {
			if !s.Privileged {
				t.Fatalf("%s is not privileged", name)
			}
			if flagValue(s.Command, "--scheduler") != "http://scheduler:9090" || flagValue(s.Command, "--advertise-url") != "http://"+name+":8000" {
				t.Fatalf("%s: scheduler or advertised URL wrong: %v", name, s.Command)
			}
			cfg, err := repository.ParseURL(flagValue(s.Command, "--repository"))
			if err != nil || cfg.Backend != repository.BackendOSS || !strings.HasPrefix(cfg.OSS.Endpoint, "s3:") {
				t.Fatalf("%s: repository %+v %v", name, cfg, err)
			}
			mounted := false
			for _, v := range s.Volumes {
				if strings.HasSuffix(v, ":"+cfg.OSS.CredentialsFile+":ro") {
					mounted = true
				}
			}
			if !mounted {
				t.Fatalf("%s: credentials file %s not mounted", name, cfg.OSS.CredentialsFile)
			}
		}
	}
	if !slices.Contains(f.Services["gateway"].Ports, "8080:8080") {
		t.Fatal("the gateway's port 8080 is not published")
	}
	if _, err := os.Stat(filepath.Join(deployDir, "compose", "s3-credentials")); err != nil {
		t.Fatal(err)
	}
}

// TestSystemdUnitsAndInstallScript: every unit runs a valid aenv command
// line (environment placeholders filled in) and stops only aenv itself on
// restart where sandboxes must survive; the install script parses.
func TestSystemdUnitsAndInstallScript(t *testing.T) {
	env := map[string]string{"AENV_LISTEN": "127.0.0.1:8000", "AENV_SCHEDULER_URL": "http://10.0.0.1:9090",
		"AENV_ADVERTISE_URL": "http://10.0.0.5:8000", "AENV_ARGS": ""}
	for _, role := range []string{"server", "node", "scheduler", "gateway"} {
		t.Run(role, func(t *testing.T) {
			b, err := os.ReadFile(filepath.Join(deployDir, "systemd", "aenv-"+role+".service"))
			if err != nil {
				t.Fatal(err)
			}
			var exec string
			killMode := ""
			for _, l := range strings.Split(string(b), "\n") {
				if v, ok := strings.CutPrefix(l, "ExecStart="); ok {
					exec = v
				}
				if v, ok := strings.CutPrefix(l, "KillMode="); ok {
					killMode = v
				}
			}
			fields := strings.Fields(os.Expand(exec, func(k string) string { return env[k] }))
			if len(fields) < 2 || fields[0] != "/usr/local/bin/aenv" || fields[1] != role {
				t.Fatalf("ExecStart=%s", exec)
			}
			checkArgs(t, fields[1:])
			if (role == "server" || role == "node") && killMode != "process" {
				t.Fatalf("KillMode=%q: a restart would kill the sandboxes", killMode)
			}
			if !strings.Contains(string(b), "WantedBy=multi-user.target") {
				t.Fatal("not enabled at boot")
			}
		})
	}
	if out, err := exec.Command("bash", "-n", filepath.Join(deployDir, "install.sh")).CombinedOutput(); err != nil {
		t.Fatalf("install.sh: %v\n%s", err, out)
	}
	if out, err := exec.Command("sh", "-n", filepath.Join(deployDir, "docker", "entrypoint.sh")).CombinedOutput(); err != nil {
		t.Fatalf("entrypoint.sh: %v\n%s", err, out)
	}
	df, err := os.ReadFile(filepath.Join(deployDir, "docker", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"./cmd/aenv", "./cmd/envd", "qemu-system-x86", "ENTRYPOINT", "VOLUME /var/lib/aenv"} {
		if !bytes.Contains(df, []byte(want)) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
}
